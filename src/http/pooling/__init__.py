"""The pooling routes (issue 43), vLLM's shapes over a `--runner pooling` engine.

`protocol` holds the request bodies and `responses` the answers; `inputs` turns a request's
`input` into token ids through `ringserve.engine.frontend.pooling_inputs`; `runner` runs
one request's inputs on the engine concurrently; the routes, one module per family:
`embeddings` (`/v1/embeddings`, `/pooling`), `classify` (`/classify`) and `score`
(`/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`). `routes.pooling_routes` lists
them for `ringserve.http.app`, whose guard refuses them on a generation server.
"""
