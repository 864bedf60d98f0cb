"""The batched sampler.

`SamplingParams` (engine/sampling_params.py, re-exported here) is validated where it is built;
`sample()` turns a batch of FP32 logits rows into token ids (+ optional top-n logprobs).

Batched on the logits' device: greedy rows are one argmax; rows that draw are filtered together
(temperature, top-k, min-p, top-p) and drawn by Gumbel-max with per-row random numbers from a
counter-based hash, so a step makes one device-to-host copy whatever its mix of parameters.

Determinism: a request with `seed` draws from its own stream, keyed by its seed and the number
of tokens it has drawn, so its output does not depend on batch neighbours, step order or the
device. Requests without a seed take fresh keys from the engine's generator.

Numerical robustness: hostile but valid parameters never produce inf/nan probabilities.
Temperatures below `GREEDY_TEMPERATURE` sample greedily; logits are shifted by their max before
dividing by the temperature (so no overflow); top-p always keeps the best token (a top_p that
rounds to 0 in FP32 means top-1); seeds are reduced modulo 2^64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashpd.engine.grammar import allowed_from_bitmask
from flashpd.engine.sampling_params import GREEDY_TEMPERATURE as GREEDY_TEMPERATURE
from flashpd.engine.sampling_params import SamplingError as SamplingError
from flashpd.engine.sampling_params import SamplingParams

SEED_MODULUS = 2**64  # torch.Generator seeds are 64-bit


@dataclass(frozen=True)
class SampleOutput:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob), best first


# Per-row random numbers for sampling, on the logits' device: a counter-based hash of (row key,
# vocab index) -> uniform (0, 1), so every row draws from its own stream in one batched op, the
# same on CPU and GPU (integer arithmetic; int64 products wrap modulo 2^64 on both).
_M64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(z: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return z - (1 << 64) if z >= 1 << 63 else z


def _mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int (64-bit unsigned arithmetic)."""
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] FP32 in (0, 1): the splitmix64 finaliser of key + (v + 1) * golden, top 24 bits."""
    v = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    z = keys[:, None] + v[None, :] * _int64(_GOLDEN)
    z = (z ^ _lsr(z, 30)) * _int64(_MIX1)
    z = (z ^ _lsr(z, 27)) * _int64(_MIX2)
    z = z ^ _lsr(z, 31)
    return (_lsr(z, 40).to(torch.float32) + 0.5) * 2.0**-24


def _on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the device's queue (a
    plain `torch.tensor(..., device=cuda)` copies synchronously: the host would wait for the
    step in flight, async scheduling)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, min-p and top-p masks on FP32 logits rows [R, V], batched.

    Each row is shifted so its max is 0 before dividing: every value stays in [-inf, 0], so a
    tiny temperature cannot overflow, and the best token always keeps probability > 0. top-k
    and min-p keep the values at or above a per-row threshold, so one descending sort (only when
    some row asks for top-p; top-k alone takes the k largest) gives the order top-p walks; top-p keeps the token that
    crosses p and always the best one (a top_p that rounds to 0 in FP32 means top-1)."""
    rows, vocab = logits.shape
    dev = logits.device
    temp = _on([p.temperature for p in params], torch.float32, dev)
    x = (logits - logits.max(dim=-1, keepdim=True).values) / temp[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    order = None
    if any(tp < 1.0 for tp in top_p):
        head, order = torch.sort(x, dim=-1, descending=True)
    elif any(top_k):  # the k largest of each row suffice
        head = torch.topk(x, max(top_k), dim=-1).values
    if any(top_k):
        k = _on([max(k, 1) - 1 for k in top_k], torch.long, dev)
        kth = head.gather(1, k[:, None])
        on = _on([k > 0 for k in top_k], torch.bool, dev)[:, None]
        x = x.masked_fill(on & (x < kth), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = _on([p.min_p for p in params], torch.float32, dev)
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if order is not None and any(tp < 1.0 for tp in top_p):
        sorted_x = x.gather(1, order)  # the masks keep a prefix of the sorted order
        probs = torch.softmax(sorted_x, dim=-1)
        p_row = _on(top_p, torch.float32, dev)[:, None]
        drop_sorted = (probs.cumsum(-1) - probs) >= p_row  # keep the token crossing p
        drop_sorted[:, 0] = False  # the best token always stays
        drop_sorted &= p_row < 1.0
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    return x


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(seed)
        self._drawn: dict[str, int] = {}  # seeded request -> tokens drawn so far

    def forget(self, request_id: str) -> None:
        self._drawn.pop(request_id, None)

    def verify_generator(self, request_id: str, params: SamplingParams, num_tokens: int) -> torch.Generator:
        """A CPU generator for one speculative verify of `request_id`: seeded from the
        request's stream (its seed and tokens drawn so far, or a fresh engine key), which then
        moves on by `num_tokens` (the most tokens the verify can emit)."""
        key = self._keys([request_id], [params])[0] & ((1 << 63) - 1)
        if params.seed is not None:
            self._drawn[request_id] = self._drawn.get(request_id, 0) + num_tokens
        return torch.Generator().manual_seed(key)

    def _keys(self, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """One 64-bit stream key per row: a seeded request's key is a function of its seed and
        how many tokens it has drawn (so its draws do not depend on batch neighbours or step
        order); rows without a seed take fresh keys from the engine's generator."""
        unseeded = sum(p.seed is None for p in params)
        fresh = torch.randint(-(2**62), 2**62, (unseeded,), generator=self._shared).tolist() if unseeded else []
        keys = []
        for rid, p in zip(request_ids, params, strict=True):
            if p.seed is None:
                keys.append(_mix64(fresh.pop() & _M64))
            else:
                n = self._drawn.get(rid, 0)
                keys.append(_mix64((int(p.seed) % SEED_MODULUS * _GOLDEN + n) & _M64))
        return [_int64(k) for k in keys]

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        bitmask: torch.Tensor | None = None,
    ) -> list[SampleOutput]:
        """logits: [B, V] (any float dtype, upcast to FP32; on any device); one row per request.
        `launch` + `PendingSamples.result`: decided on the device, one copy to the host."""
        return self.launch(logits, request_ids, params, bitmask).result()

    def launch(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        bitmask: torch.Tensor | None = None,
    ) -> PendingSamples:
        """Decide every row where the logits are, without waiting for the device.

        Greedy rows by one batched argmax, the rest by one batched filter (temperature, top-k,
        min-p, top-p) and a Gumbel-max draw (argmax of the filtered logits plus -log(-log(u)),
        u from the row's own counter-based stream: a draw from softmax of the filtered logits).
        Token ids, their logprobs and the top-n logprobs asked for go to the host in ONE
        asynchronous copy; `PendingSamples.tokens` keeps the ids on the device (a next step
        can read them before the host has). A row whose logits are all non-finite (or contain
        +inf) takes the argmax of its NaN-cleaned logits. A seeded request's stream moves on
        here, once per launched row.

        bitmask: [B, ceil(V / 32)] int32 from the grammar (`engine/grammar.py`), bit t of a
        row allowing token t: disallowed tokens get -inf before greedy, filters and draw
        (structured outputs). Logprobs stay those of the model's own distribution."""
        logits = logits.float()
        num_rows = logits.shape[0]
        if num_rows != len(request_ids) or num_rows != len(params):
            raise ValueError(f"{num_rows} logits rows for {len(request_ids)} requests")
        logprobs_all = torch.log_softmax(logits, dim=-1)  # [B, V]
        clean = torch.nan_to_num(logits, nan=-math.inf)
        if bitmask is not None:
            allowed = allowed_from_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
            clean = clean.masked_fill(~allowed, -math.inf)
        tokens = torch.argmax(clean, dim=-1)  # [B]
        drawn = [row for row, p in enumerate(params) if not p.greedy]
        if drawn:
            dp = [params[row] for row in drawn]
            rows = _on(drawn, torch.long, logits.device)
            x = _filter_rows(clean[rows], dp)
            keys = _on(self._keys([request_ids[r] for r in drawn], dp), torch.int64, logits.device)
            gumbel = -torch.log(-torch.log(_uniform(keys, logits.shape[1])))
            picked = torch.argmax(torch.nan_to_num(x + gumbel, nan=-math.inf), dim=-1)
            ok = torch.isfinite(clean[rows].max(dim=-1).values)  # else: argmax of the row
            tokens = tokens.index_put((rows,), torch.where(ok, picked, tokens[rows]))
        chosen = logprobs_all.gather(1, tokens[:, None])  # [B, 1]
        top_n = max((p.logprobs for p in params), default=0)
        packed = [tokens[:, None].double(), chosen.double()]
        if top_n:
            vals, ids = torch.topk(logprobs_all, top_n, dim=-1)
            packed += [ids.double(), vals.double()]
        pending = PendingSamples(tokens, torch.cat(packed, dim=1), list(params), top_n)
        for row in drawn:  # a seeded request's stream moves on once per sampled token
            if params[row].seed is not None:
                rid = request_ids[row]
                self._drawn[rid] = self._drawn.get(rid, 0) + 1
        return pending


class PendingSamples:
    """A launched batch of samples: `tokens` [B] on the device now, `result()` on the host
    (waits for the one device-to-host copy of the step)."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, params: list[SamplingParams], top_n: int) -> None:
        self.tokens, self._params, self._top_n = tokens, params, top_n
        self._event = None
        if packed.is_cuda:  # pinned host buffer + event: the copy runs behind the queued work
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed.cpu()
        self._outs: list[SampleOutput] | None = None

    def result(self) -> list[SampleOutput]:
        if self._outs is None:
            if self._event is not None:
                self._event.synchronize()
            top_n, outs = self._top_n, []
            for vals, p in zip(self._host.tolist(), self._params, strict=True):  # Python floats
                top: tuple[tuple[int, float], ...] = ()
                if p.logprobs:
                    top = tuple(
                        (int(i), v)
                        for i, v in zip(vals[2 : 2 + p.logprobs], vals[2 + top_n : 2 + top_n + p.logprobs], strict=True)
                    )
                outs.append(SampleOutput(int(vals[0]), vals[1], top))
            self._outs = outs
        return self._outs


# ---------------------------------------------------------------- speculative decoding
def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Per row, the distribution the sampler draws from: softmax of the row's temperature /
    top-k / min-p / top-p filtered logits (FP32 [R, V]); a greedy row is a point mass on its
    argmax. Speculative acceptance filters the target's p and the drafter's q with this."""
    clean = torch.nan_to_num(logits.float(), nan=-math.inf)
    out = torch.zeros_like(clean)
    greedy = [row for row, p in enumerate(params) if p.greedy]
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = torch.tensor(greedy, dtype=torch.long, device=clean.device)
        out[rows, clean[rows].argmax(-1)] = 1.0
    if drawn:
        rows = torch.tensor(drawn, dtype=torch.long, device=clean.device)
        out[rows] = torch.softmax(_filter_rows(clean[rows], [params[r] for r in drawn]), dim=-1)
    return out
