"""A plain-torch EAGLE head, written from the published architecture, for the tests: the
drafts a head proposes for a token sequence, computed over the whole sequence at once from
transformers' hidden states (no paged cache, no ringserve module)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


class ReferenceHead:
    """The head in `head_dir`, for the target `hf_model` (a transformers causal LM)."""

    def __init__(self, head_dir: Path, hf_model: torch.nn.Module, method: str) -> None:
        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.w = {k.replace("midlayer.", "layers.0."): v.float()
                  for k, v in load_file(str(head_dir / "model.safetensors")).items()}
        self.hf = hf_model
        self.method = method
        self.eps = float(self.cfg["rms_norm_eps"])
        eagle = self.cfg.get("eagle_config") or {}
        self.aux = eagle.get("eagle_aux_hidden_state_layer_ids")

    @torch.inference_mode()
    def features(self, tokens: list[int]) -> torch.Tensor:
        """The target's features at every position of `tokens`."""
        out = self.hf(torch.tensor([tokens]), output_hidden_states=True)
        states = out.hidden_states
        if self.method == "eagle3":
            return torch.cat([states[i][0] for i in self.aux], -1)
        return states[-1][0]  # the final normed hidden states

    def _embed(self, ids: list[int]) -> torch.Tensor:
        table = self.w.get("embed_tokens.weight")
        if table is None:
            table = self.hf.get_input_embeddings().weight.float()
        return table[torch.tensor(ids)]

    def _layer(self, i: int, stream: torch.Tensor, emb: torch.Tensor | None, pos: torch.Tensor,
               cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Rows `stream` at positions `pos`, attending to `cache[i]`'s earlier keys too."""
        w, c, p = self.w, self.cfg, f"layers.{i}."
        heads, kvh, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        if self.method == "eagle3" and i == 0:
            normed = _rms(stream, w[p + "hidden_norm.weight"], self.eps)
            if c.get("norm_before_residual"):
                stream = normed
            x = torch.cat([_rms(emb, w[p + "input_layernorm.weight"], self.eps), normed], -1)
        elif p + "input_layernorm.weight" in w:
            x = _rms(stream, w[p + "input_layernorm.weight"], self.eps)
        else:
            x = stream
        n = x.shape[0]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, hd)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, kvh, hd)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kvh, hd)
        theta = float(c.get("rope_theta", 10000.0))
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        old_k, old_v = cache[i]
        keys, values = torch.cat([old_k, k]), torch.cat([old_v, v])
        cache[i] = (keys, values)
        total = keys.shape[0]
        keys = keys.repeat_interleave(heads // kvh, 1)
        values = values.repeat_interleave(heads // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / hd**0.5
        allowed = torch.arange(total)[None, :] <= (total - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, heads * hd)
        stream = stream + attn @ w[p + "self_attn.o_proj.weight"].T
        y = _rms(stream, w[p + "post_attention_layernorm.weight"], self.eps)
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        return stream + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    def _run(self, ids: list[int], pos: torch.Tensor, hidden: torch.Tensor, project: bool,
             cache: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self._embed(ids)
        if self.method == "eagle3":
            stream = hidden @ self.w["fc.weight"].T if project else hidden
        else:
            stream = torch.cat([emb, hidden], -1) @ self.w["fc.weight"].T + self.w["fc.bias"]
        for i in range(int(self.cfg["num_hidden_layers"])):
            stream = self._layer(i, stream, emb if i == 0 else None, pos, cache)
        out = _rms(stream, self.w["norm.weight"], self.eps) if "norm.weight" in self.w else stream
        return out, stream

    def _token(self, out: torch.Tensor) -> int:
        if "lm_head.weight" in self.w:
            best = int((out @ self.w["lm_head.weight"].T).argmax())
            return best + int(self.w["d2t"][best]) if "d2t" in self.w else best
        return int(self.hf.get_output_embeddings()(out[None])[0].argmax())

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k drafts after `tokens` (the head caught up over every position)."""
        n = len(tokens)
        feats = self.features(tokens[:-1])
        layers = int(self.cfg["num_hidden_layers"])
        hd, kvh = self.cfg["head_dim"], self.cfg["num_key_value_heads"]
        cache = [(torch.empty(0, kvh, hd), torch.empty(0, kvh, hd)) for _ in range(layers)]
        out, stream = self._run(tokens[1:], torch.arange(n - 1), feats, True, cache)
        drafts = [self._token(out[-1])]
        last = stream[-1:]
        for j in range(1, k):
            out, last = self._run([drafts[-1]], torch.tensor([n - 2 + j]), last, False, cache)
            drafts.append(self._token(out[-1]))
        return drafts
