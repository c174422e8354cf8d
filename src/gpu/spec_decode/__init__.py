"""Speculative decoding (issue 41): one proposer module per method behind a `Proposer`
protocol. The scheduler schedules `1 + k` tokens per speculating request, the model runner asks
the proposer for drafts after each step, and the rejection sampler lives in
`ringserve.gpu.sample`. Nothing is here yet: `--speculative-config` is refused.
"""
