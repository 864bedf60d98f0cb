"""The batched sampler.

`SamplingParams` (engine/sampling_params.py, re-exported here) is validated where it is built;
`sample()` turns a batch of FP32 logits rows into token ids (+ optional top-n logprobs).

Determinism: a request with `seed` draws from its own `torch.Generator`, advanced once per
sampled token, so its output does not depend on batch neighbours or step order. Requests without
a seed share the engine's generator.

Numerical robustness: hostile but valid parameters never produce inf/nan probabilities.
Temperatures below `GREEDY_TEMPERATURE` sample greedily; logits are shifted by their max before
dividing by the temperature (so no overflow); top-p always keeps the best token (a top_p that
rounds to 0 in FP32 means top-1); seeds are reduced modulo 2^64 for the generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashpd.engine.sampling_params import GREEDY_TEMPERATURE as GREEDY_TEMPERATURE
from flashpd.engine.sampling_params import SamplingError as SamplingError
from flashpd.engine.sampling_params import SamplingParams

SEED_MODULUS = 2**64  # torch.Generator seeds are 64-bit


@dataclass(frozen=True)
class SampleOutput:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob), best first


def _filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks on one row of FP32 logits [V].

    The row is shifted so its max is 0 before dividing: every value stays in [-inf, 0], so a
    tiny temperature cannot overflow, and the best token always keeps probability > 0."""
    x = (logits - logits.max()) / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= p.top_p  # keep the token crossing p
        drop_sorted[0] = False  # the best token always stays (top_p may round to 0 in FP32)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _generator(self, request_id: str, p: SamplingParams) -> torch.Generator:
        if p.seed is None:
            return self._shared
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(int(p.seed) % SEED_MODULUS)
            self._per_request[request_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[SampleOutput]:
        """logits: [B, V] (any float dtype, upcast to FP32; on any device); one row per request.

        Greedy rows are decided where the logits are, in one batched argmax, and reach the host
        in ONE copy (token ids, their logprobs, the top-n logprobs asked for); rows that draw
        from a distribution are copied to the host one by one (their generators live there)."""
        logits = logits.float()
        num_rows = logits.shape[0]
        if num_rows != len(request_ids) or num_rows != len(params):
            raise ValueError(f"{num_rows} logits rows for {len(request_ids)} requests")
        logprobs_all = torch.log_softmax(logits, dim=-1)  # [B, V]
        drawn = [row for row, p in enumerate(params) if not p.greedy]
        tokens = torch.argmax(torch.nan_to_num(logits, nan=-math.inf), dim=-1)  # [B]
        if drawn:
            host = logits[drawn].cpu()
            picked = [self._sample_row(host[i], request_ids[row], params[row])
                      for i, row in enumerate(drawn)]
            tokens = tokens.index_put((torch.tensor(drawn, device=logits.device),),
                                      torch.tensor(picked, device=logits.device))
        chosen = logprobs_all.gather(1, tokens[:, None])  # [B, 1]
        top_n = max((p.logprobs for p in params), default=0)
        packed = [tokens[:, None].double(), chosen.double()]
        if top_n:
            vals, ids = torch.topk(logprobs_all, top_n, dim=-1)
            packed += [ids.double(), vals.double()]
        host = torch.cat(packed, dim=1).cpu()  # the one device-to-host copy of the step
        outs = []
        for row, p in enumerate(params):
            token = int(host[row, 0])
            top: tuple[tuple[int, float], ...] = ()
            if p.logprobs:
                ids_row = host[row, 2:2 + p.logprobs]
                vals_row = host[row, 2 + top_n:2 + top_n + p.logprobs]
                top = tuple((int(i), float(v)) for i, v in zip(ids_row, vals_row, strict=True))
            outs.append(SampleOutput(token, float(host[row, 1]), top))
        return outs

    def _sample_row(self, row: torch.Tensor, request_id: str, p: SamplingParams) -> int:
        """One token from one row [V] (host); argmax when the filtered distribution is
        degenerate (non-finite logits from the model), never an inf/nan error."""
        row = torch.nan_to_num(row, nan=-math.inf)
        if p.greedy or not bool(torch.isfinite(row).any()):
            return int(torch.argmax(row))
        probs = torch.softmax(_filter_logits(row, p), dim=-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return int(torch.argmax(row))
        return int(torch.multinomial(probs, 1, generator=self._generator(request_id, p)))
