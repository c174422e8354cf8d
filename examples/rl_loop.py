#!/usr/bin/env python3
"""A small GRPO-style RL loop on the CPU: ringserve samples, transformers trains, and the new
weights go back into the running engine after every optimiser step.

The policy is the demo model (a random-weight Llama: hidden 256, 4 layers, vocab 8000) loaded
twice: by `ringserve.LLM`, started with weight transfer on, which generates the rollouts, and
by transformers, which is the policy being trained. Each step:

1. rollout: for every prompt, one request for a group of G completions (temperature 1.0, a
   seed per request, so a run is reproducible) with the sampled tokens' logprobs;
2. reward: the fraction of a completion's tokens whose decoded text contains a digit 0-9
   (270 of the 8000 ids: the untrained policy scores about 0.04, a perfect one 1.0);
3. advantages, normalised within each group: (reward - group mean) / (group std + eps);
4. train: the policy-gradient loss -mean(advantage * sum log pi(token)), log pi from
   transformers run over prompt + completion (teacher forcing), then one AdamW step;
5. sync: `TrainerWeightTransferEngine.send_weights()` pushes every parameter into the engine
   (shm: the workers read the policy's parameters in place, `SharedWeights`; or a gloo group)
   and returns the version the next rollouts must report.

Two checks tie the halves together: every completion must report the version sent last
(None before the first), and the engine's logprobs of the sampled tokens must equal the
policy's own before its update ("|dlogp|": their mean absolute difference).

There is no KL penalty or reference model, so the policy is free to collapse: with the
defaults it ends up repeating one number ("30303030..."), which is what this reward asks for.

    .venv/bin/python examples/rl_loop.py [--steps 20] [--group-size 8] [--prompts 4]
        [--lr 5e-3] [--seed 0] [--backend shm|gloo] [--max-tokens 16]

Prints one line per step and, at the end, "reward first k steps mean ... -> last k steps
mean ..."; exits with status 1 when the reward did not rise, 2 when a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ringserve import LLM, SamplingParams
from ringserve.gpu.testing import demo_model_path
from ringserve.weight_transfer import (
    ModuleWeightSource,
    SharedWeights,
    TrainerWeightTransferEngine,
)

PROMPTS = [
    "The numbers are",
    "Count with me:",
    "My phone number is",
    "In the year",
    "Here is a list:",
    "The answer is",
    "Step one, step two,",
    "Once upon a time",
]
ENGINE_ARGS: dict[str, Any] = {"device": "cpu", "max_model_len": 256,
                               "kv_cache_memory": 64 << 20, "disable_log_stats": True}
MAX_LOGPROB_DIFF = 1e-2  # engine vs policy, mean |difference| per step: float32 noise is ~1e-6


class CheckFailed(Exception):
    """The engine did not serve the weights the trainer sent."""


@dataclass
class Group:
    """One prompt's rollouts: its token ids, and G completions with the engine's logprobs of
    their tokens and their rewards."""

    prompt_ids: list[int]
    completions: list[list[int]]
    engine_logprobs: list[list[float]]
    rewards: list[float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimiser steps (default 20)")
    parser.add_argument("--group-size", type=int, default=8,
                        help="completions per prompt, G >= 2 (default 8)")
    parser.add_argument("--prompts", type=int, default=4,
                        help=f"prompts per step, 1-{len(PROMPTS)} (default 4)")
    parser.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (default 5e-3)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--backend", choices=("shm", "gloo"), default="shm",
                        help="weight transfer backend (default shm)")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="tokens per completion (default 16)")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be between 1 and {len(PROMPTS)}, got {args.prompts}")
    if args.group_size < 2:
        parser.error(f"--group-size must be >= 2 (advantages are relative to the group), "
                     f"got {args.group_size}")
    for flag, value in (("--steps", args.steps), ("--max-tokens", args.max_tokens)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    return args


def digit_token_ids(tokenizer: Any) -> set[int]:
    """The ids whose decoded text contains an ASCII digit: the reward's target set.

    Decoded, not the raw vocabulary entry: byte-level BPE spells bytes with characters such
    as "²" that `str.isdigit` accepts, which the policy would learn to emit instead of digits.
    """
    return {i for i in range(len(tokenizer))
            if any(ch in "0123456789" for ch in tokenizer.decode([i]))}


def reward(tokens: list[int], targets: set[int]) -> float:
    """The fraction of `tokens` in `targets`."""
    return sum(t in targets for t in tokens) / max(len(tokens), 1)


def rollout(llm: LLM, prompts: list[str], args: argparse.Namespace, step: int,
            targets: set[int], expected_version: str | None) -> list[Group]:
    """G completions per prompt, scored.

    Raises:
        CheckFailed: a completion was not sampled with `expected_version`.
    """
    # Request r's G children get seeds base + r*G + j (ringserve adds the child's index):
    # distinct across the run, the same in every run with this --seed.
    base = args.seed * 1_000_000
    params = [SamplingParams(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens,
                             ignore_eos=True, logprobs=0,
                             seed=base + (step * len(PROMPTS) + i) * args.group_size)
              for i in range(len(prompts))]
    groups = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completions, logprobs = [], []
        for completion in output.outputs:
            if completion.weight_version != expected_version:
                raise CheckFailed(f"a rollout reports weight version "
                                  f"{completion.weight_version!r}, expected {expected_version!r}")
            if completion.logprobs is None:
                raise CheckFailed("a completion came back without the logprobs asked for")
            completions.append(list(completion.token_ids))
            logprobs.append([position[token].logprob for position, token
                             in zip(completion.logprobs, completion.token_ids, strict=True)])
        groups.append(Group(list(output.prompt_token_ids or []), completions, logprobs,
                            [reward(c, targets) for c in completions]))
    return groups


def advantages(rewards: list[float], eps: float = 1e-4) -> torch.Tensor:
    """(reward - group mean) / (group std + eps)."""
    r = torch.tensor(rewards)
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


def train_step(policy: Any, opt: torch.optim.Optimizer, groups: list[Group]) -> tuple[float, float]:
    """One policy-gradient step over every group (one forward per group: its sequences have
    one length).

    Returns:
        The loss, and the mean |engine logprob - policy logprob| of the sampled tokens.
    """
    opt.zero_grad()
    samples = sum(len(g.completions) for g in groups)
    total_loss, diff_sum, diff_count = 0.0, 0.0, 0
    for group in groups:
        adv = advantages(group.rewards)
        learns = bool(adv.abs().sum() > 0)  # all rewards equal: no gradient, forward only
        n_prompt = len(group.prompt_ids)
        ids = torch.tensor([group.prompt_ids + c for c in group.completions])
        tokens = ids[:, n_prompt:]
        with torch.set_grad_enabled(learns):
            logits = policy(ids).logits[:, n_prompt - 1:-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            loss = -(adv * logp.sum(dim=-1)).sum() / samples
        if learns:
            torch.autograd.backward(loss)
        total_loss += float(loss.detach())
        diff_sum += float((logp.detach() - torch.tensor(group.engine_logprobs)).abs().sum())
        diff_count += tokens.numel()
    opt.step()
    return total_loss, diff_sum / max(diff_count, 1)


def run(args: argparse.Namespace) -> int:
    """The loop; returns the exit status."""
    model_dir = str(demo_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    targets = digit_token_ids(tokenizer)
    print(f"reward: the fraction of generated tokens whose text contains a digit 0-9 "
          f"({len(targets)} of {len(tokenizer)} token ids)")
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    prompts = PROMPTS[:args.prompts]
    config = {"backend": args.backend}
    history: list[float] = []
    worst_diff = 0.0
    # shm: the policy's parameters move into shared memory, where the engine's workers read
    # them in place at every sync (nothing is copied on the trainer's side).
    source = SharedWeights(policy) if args.backend == "shm" else ModuleWeightSource(policy)
    with contextlib.ExitStack() as stack:
        if isinstance(source, SharedWeights):
            stack.enter_context(source)  # unlinked at the end
        llm = stack.enter_context(LLM(model_dir, weight_transfer_config=config, **ENGINE_ARGS))
        trainer = stack.enter_context(TrainerWeightTransferEngine(config, llm))
        trainer.trainer_init(source)
        version: str | None = None  # the start-up weights
        print(f"{'step':>4} {'reward':>7} {'loss':>8} {'|dlogp|':>8} {'version':>7} "
              f"{'rollout s':>9} {'train s':>7} {'sync s':>6}")
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            groups = rollout(llm, prompts, args, step, targets, version)
            t1 = time.perf_counter()
            loss, diff = train_step(policy, opt, groups)
            t2 = time.perf_counter()
            version = trainer.send_weights()
            t3 = time.perf_counter()
            history.append(statistics.fmean(r for g in groups for r in g.rewards))
            worst_diff = max(worst_diff, diff)
            print(f"{step:>4} {history[-1]:>7.3f} {loss:>8.3f} {diff:>8.1e} {version:>7} "
                  f"{t1 - t0:>9.2f} {t2 - t1:>7.2f} {t3 - t2:>6.2f}", flush=True)
            if diff > MAX_LOGPROB_DIFF:
                raise CheckFailed(f"the engine's logprobs differ from the policy's by {diff:.2e} "
                                  f"on average (more than {MAX_LOGPROB_DIFF})")
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                                seed=args.seed)
        sample = llm.generate(prompts[0], params, use_tqdm=False)[0].outputs[0]
        print(f"sample (version {sample.weight_version}): {prompts[0]!r} -> {sample.text!r}")
    print(f"largest |dlogp| in a step: {worst_diff:.1e}")
    return summarize(history)


def summarize(history: list[float]) -> int:
    """Print the reward's first-k and last-k step means; 0 when it rose, else 1."""
    k = max(1, min(5, len(history) // 3))
    first, last = statistics.fmean(history[:k]), statistics.fmean(history[-k:])
    print(f"reward first {k} steps mean {first:.3f} -> last {k} steps mean {last:.3f}")
    if last <= first:
        print("FAIL: the reward did not rise")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and run the loop."""
    args = parse_args(argv)
    try:
        return run(args)
    except CheckFailed as exc:
        print(f"FAIL: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
