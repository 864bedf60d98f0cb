"""`flashpd train --drafter`: train the DSpark drafter of a trained checkpoint (frozen backbone).

    flashpd train --drafter --preset small --base model/presets/small_checkpoint \\
        --out checkpoints/small_dspark --minutes 10 --device cuda

1. Teacher data. The frozen backbone (the serving `Model`, its config given the preset's drafter
   keys) runs each training row once: the tap rows [n, n_taps*D] and its greedy next-token
   predictions g [n] (g_i predicts token i+1).
2. Training. FP32 master weights named as `drafter_manifest`, fake-quantised to their checkpoint
   formats with straight-through gradients each step, run by the serving drafter's own forward
   (`DSparkDrafter.context_kv` / `block_pass` / `markov_bias` / `confidence`). A block is
   anchored at a position a of a row (1 <= a <= n-k):

       context   the W positions a-W .. a-1 (K/V from the tap rows; < 0 invisible)
       block     [t_a, noise x (k-1)] at a .. a+k-1
       labels    y_j = g_{a+j}, j < k (the backbone's next token at each slot)
       Markov    prev_0 = t_a, prev_j = y_{j-1} (teacher forcing)
       loss      CE(U_j + B(prev_j), y_j) + BCE(c_j, [argmax(U_j + B(prev_j)) == y_j]),
                 the confidence head on detached hiddens (it calibrates, it does not steer)

   The routing biases stay 0 (no load balancing for the drafter's few experts).
   `--slot-weights survival` weights slot j's CE by prod_{i<j} p_i(y_i) (`slot_weights`).
   `--teacher-source greedy` (self-distillation): a row is a training prompt (its first P tokens,
   P uniform in [--prompt-min, --prompt-max]) + the backbone's greedy continuation
   (--greedy-tokens), generated in batches (`greedy_chains`; the serving `GpuModel` on cuda),
   then labelled like a text row: for i >= P-1, g_i is the row's token i+1. `mix` takes a
   --greedy-fraction share of the rows from each source.
3. Export. The backbone's files are copied, the `mtp.*` tensors are written in their released
   formats to extra shards, the index merged, and config.json gains the drafter keys.
4. Acceptance length at k drafts on held-out prompts (`acceptance_length`): the backbone's
   greedy continuation of each prompt (taps recorded), then the greedy speculative walk over
   it: draft from the anchor, accept the prefix equal to the continuation, commit the anchor
   and the accepted drafts (their tap rows), move by accepted + 1. With a batch-invariant
   forward this is exactly what greedy speculative decoding emits per step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashpd.kernels.quant import ref as quant
from flashpd.model.checkpoint import (
    INDEX_FILE,
    checkpoint_manifest,
    drafter_manifest,
    is_scale,
    load_checkpoint,
    logical_shape,
    plan_shards,
    shard_file_names,
    write_index_and_config,
)
from flashpd.model.config import ModelConfig
from flashpd.model.dspark import DSparkDrafter, greedy_choose
from flashpd.model.model import LogitsRequest, Model, SeqInput, SeqPlan
from flashpd.model.train import _act_ste, _format_of, _fq_fp8_block, _fq_mxfp4, _init, _key, _ste, export_tensors
from flashpd.model.weights import drafter_weights_from


# ============================================================================ the trainable drafter
class _SteQuant:
    """The activation fake quant the drafter calls, with a straight-through gradient."""

    @staticmethod
    def fake_quant_fp8_ue8m0(x: torch.Tensor) -> torch.Tensor:
        return _act_ste(x, quant.fake_quant_fp8_ue8m0)


class _MasterReader:
    """`weights._Reader`'s interface over fake-quantised FP32 master weights (`drafter_weights_from`)."""

    def __init__(self, model: TrainDrafter):
        self.m = model

    def plain(self, name: str) -> torch.Tensor:
        return self.m.w(name)

    def fp32(self, name: str) -> torch.Tensor:
        return self.m.w(name)

    def fp8(self, prefix: str) -> torch.Tensor:
        return self.m.w(prefix + ".weight")

    def mxfp4(self, prefix: str) -> torch.Tensor:
        return self.m.w(prefix + ".weight")


class TrainDrafter(torch.nn.Module):
    """FP32 master weights of the drafter, named as `drafter_manifest`; the forward is the
    serving drafter's over their fake-quantised values (module docstring)."""

    def __init__(self, cfg: ModelConfig, target: Model, seed: int = 0):
        super().__init__()
        if target.dtype != torch.float32:
            raise ValueError("train the drafter over an FP32 backbone")
        self.cfg = cfg
        specs = {n: s for n, s in drafter_manifest(cfg).items() if not is_scale(s)}
        self.formats = {n: _format_of(n, s) for n, s in specs.items()}
        g = torch.Generator().manual_seed(seed)
        # mtp.s.X initialises as layers.s.X would (norms 1, sink 0, mHC near the identity, ...)
        self.params = torch.nn.ParameterDict(
            {
                _key(n): torch.nn.Parameter(_init("layers." + n.split(".", 1)[1], logical_shape(s), cfg, g))
                for n, s in specs.items()
            }
        )
        self.to(target.device)
        self.drafter = DSparkDrafter(
            cfg, drafter_weights_from(cfg, _MasterReader(self)), target, kernels={"quant": _SteQuant}
        )

    def raw(self, name: str) -> torch.Tensor:
        return self.params[_key(name)]

    def w(self, name: str) -> torch.Tensor:
        """The weight as the checkpoint will hold it (straight-through gradient)."""
        p, fmt = self.raw(name), self.formats[name]
        if fmt == "fp8_block":
            return _ste(p, lambda t: _fq_fp8_block(t, self.cfg.weight_block_size))
        if fmt == "mxfp4":
            return _ste(p, _fq_mxfp4)
        if fmt == "bf16":
            return _ste(p, lambda t: t.to(torch.bfloat16).float())
        return p

    def refresh(self) -> DSparkDrafter:
        """The drafter over the current master weights (call once per step)."""
        self.drafter.w = drafter_weights_from(self.cfg, _MasterReader(self))
        return self.drafter


# ============================================================================ teacher data
@dataclass(frozen=True)
class TeacherRow:
    ids: torch.Tensor  # [n] int64: the row's tokens (pad tail dropped)
    taps: torch.Tensor  # [n, n_taps*D]: the backbone's tap at every position
    greedy: torch.Tensor  # [n] int64: the backbone's argmax next token at every position


@torch.no_grad()
def teacher_rows(target: Model, rows: torch.Tensor, pad: int, per_forward: int = 4, log=print) -> list[TeacherRow]:
    """Run the frozen backbone over every row (a few rows per forward)."""
    t0 = time.time()
    out = teacher_forward(target, [r[: int((r != pad).sum())] for r in rows], per_forward)
    log(f"teacher: {len(out)} rows, {sum(r.ids.numel() for r in out)} tokens ({time.time() - t0:.0f} s)")
    return out


@torch.no_grad()
def teacher_forward(target: Model, seqs: Sequence[torch.Tensor], per_forward: int = 4) -> list[TeacherRow]:
    """The backbone over each id sequence (prefill, fresh state): taps and argmax next tokens
    at every position. Sequences of one token are dropped (no label to learn from)."""
    out = []
    for i in range(0, len(seqs), per_forward):
        chunk = [r for r in seqs[i : i + per_forward] if r.numel() > 1]
        if not chunk:
            continue
        segs = [SeqInput(target.new_state(), 0, r.numel(), SeqPlan(logits=LogitsRequest.ALL)) for r in chunk]
        logits, taps = target.forward_taps(torch.cat(chunk).to(target.device), segs)
        for j, (r, lg) in enumerate(zip(chunk, logits, strict=True)):
            values, _ = taps.of(j)
            out.append(TeacherRow(r, values.float().cpu(), lg.argmax(-1).cpu()))
    return out


# ============================================================================ self-distillation
# `--teacher-source greedy`: the rows are a training prompt followed by the backbone's own greedy
# continuation, the text the held-out acceptance length walks (`acceptance_length`), instead of
# ShareGPT text the backbone only labels. Generation is batched: every decode step is one forward
# over all sequences (each its own state); the taps and labels then come from one prefill of
# each finished row through `teacher_forward`, so a greedy row's label at position i >= P-1 is
# its token i+1 (the backbone's argmax there is what the chain took) and the label definition is
# the text mode's (`drafter_loss`: y_j = g_{a+j}).
@dataclass(frozen=True)
class GreedySpec:
    prompt_min: int  # prompt tokens, drawn uniformly in [prompt_min, prompt_max] per row
    prompt_max: int
    new_tokens: int  # greedy tokens generated after each prompt
    decode_batch: int = 256  # sequences per decode forward (the GPU path's largest graph bucket)
    prefill_tokens: int = 4096  # prompt tokens per prefill forward

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(f"prompt tokens: need 1 <= min <= max, got {self.prompt_min}, {self.prompt_max}")
        if self.new_tokens < 1 or self.decode_batch < 1 or self.prefill_tokens < 1:
            raise ValueError("new_tokens, decode_batch and prefill_tokens must be >= 1")


@torch.no_grad()
def greedy_chains(
    model: Model, prompts: Sequence[Sequence[int]], new_tokens: int, states=None, spec: GreedySpec | None = None
) -> list[list[int]]:
    """Each prompt's greedy continuation (new_tokens ids), batched: prompts prefilled a few per
    forward, then one forward per decode step over up to spec.decode_batch sequences.
    states: one fresh `SeqState` per prompt (default `model.new_state()`; `paged_states` for the
    GPU path). Token for token what `greedy_continuation` gives for each prompt alone."""
    spec = spec or GreedySpec(1, 1, new_tokens)
    states = [model.new_state() for _ in prompts] if states is None else list(states)
    if len(states) != len(prompts):
        raise ValueError(f"{len(states)} states for {len(prompts)} prompts")
    chains: list[list[int]] = []
    for group in _prefill_groups([len(p) for p in prompts], spec.prefill_tokens):
        ids = torch.tensor([t for i in group for t in prompts[i]], dtype=torch.long, device=model.device)
        seqs = [SeqInput(states[i], 0, len(prompts[i])) for i in group]
        chains += [[t] for t in _argmax_last(model.forward(ids, seqs))]
    for _ in range(new_tokens - 1):
        for lo in range(0, len(prompts), spec.decode_batch):
            part = range(lo, min(lo + spec.decode_batch, len(prompts)))
            ids = torch.tensor([chains[i][-1] for i in part], dtype=torch.long, device=model.device)
            seqs = [SeqInput(states[i], states[i].num_tokens, 1) for i in part]
            for i, t in zip(part, _argmax_last(model.forward(ids, seqs)), strict=True):
                chains[i].append(t)
    return chains


def _prefill_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive indices grouped so a group's lengths sum to <= budget (a longer one alone)."""
    groups, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and used + n > budget:
            groups, cur, used = groups + [cur], [], 0
        cur, used = cur + [i], used + n
    return groups + [cur] if cur else groups


def _argmax_last(logits: Sequence[torch.Tensor]) -> list[int]:
    """The argmax of each sequence's last logits row (one device sync)."""
    return torch.stack([lg[-1] for lg in logits]).argmax(-1).tolist()


def paged_states(model: Model, lengths: Sequence[int]) -> list:
    """One `PagedSeqState` per sequence over fresh `KVPools` sized for `lengths` tokens each
    (disjoint blocks, one slot each, scratch rows for one prefill group or decode batch)."""
    from flashpd.engine.hashing import CHUNK_TOKENS
    from flashpd.engine.kv_pools import KVPools, PagedSeqState

    per = [-(-n // CHUNK_TOKENS) for n in lengths]
    max_rows = max(4096, len(lengths), max(lengths))
    pools = KVPools.for_model(model, sum(per), len(lengths), model.device, max_rows)
    states, first = [], 0
    for slot, k in enumerate(per):
        states.append(PagedSeqState(pools, slot, list(range(first, first + k)), model.dtype))
        first += k
    return states


def greedy_prompts(rows: torch.Tensor, pad: int, count: int, spec: GreedySpec, gen: torch.Generator) -> list[list[int]]:
    """`count` prompts: the first P tokens (P uniform in [prompt_min, prompt_max], at most the
    row's length) of the given training rows, in order; rows shorter than prompt_min are skipped."""
    out = []
    for r in rows:
        ids = r[r != pad].tolist()
        if len(ids) < spec.prompt_min:
            continue
        p = int(torch.randint(spec.prompt_min, spec.prompt_max + 1, (), generator=gen))
        out.append(ids[: min(p, len(ids))])
        if len(out) == count:
            break
    return out


@torch.no_grad()
def greedy_teacher_rows(
    target: Model, prompts: Sequence[Sequence[int]], spec: GreedySpec, generator=None, log=print
) -> list[TeacherRow]:
    """Teacher rows = prompt + the greedy continuation. generator: (model, states factory) that
    generates the tokens (default: the target itself on per-sequence dense states); the taps and
    labels are always the target's (one prefill per row)."""
    t0 = time.time()
    model, make_states = generator or (target, None)
    states = make_states([len(p) + spec.new_tokens for p in prompts]) if make_states else None
    chains = greedy_chains(model, prompts, spec.new_tokens, states, spec)
    t1 = time.time()
    seqs = [torch.tensor(list(p) + c, dtype=torch.long) for p, c in zip(prompts, chains, strict=True)]
    rows = teacher_forward(target, seqs)
    agree = _chain_agreement(rows, [len(p) for p in prompts])
    log(
        f"teacher (greedy): {len(rows)} rows, {len(rows) * spec.new_tokens} generated tokens in {t1 - t0:.0f} s "
        f"({len(rows) * spec.new_tokens / max(t1 - t0, 1e-9):.0f} tok/s), taps {time.time() - t1:.0f} s; "
        f"labels equal to the chain's next token at {agree:.4f} of generated positions"
    )
    return rows


def _chain_agreement(rows: Sequence[TeacherRow], prompt_lens: Sequence[int]) -> float:
    """Fraction of positions i in [P-1, n-1) whose label is the row's token i+1 (1.0 when the
    generator is the target's own forward, up to argmax ties)."""
    same = total = 0
    for row, p in zip(rows, prompt_lens, strict=True):
        same += int((row.greedy[p - 1 : -1] == row.ids[p:]).sum())
        total += row.ids.numel() - p
    return same / max(total, 1)


# ============================================================================ the loss
def block_batch(
    rows: Sequence[TeacherRow], blocks_per_row: int, k: int, gen: torch.Generator
) -> list[tuple[TeacherRow, torch.Tensor]]:
    """(row, anchor positions a [m]) per row long enough for a block (1 <= a <= n-k)."""
    out = []
    for row in rows:
        n = row.ids.numel()
        if n - k >= 1:
            out.append((row, torch.randint(1, n - k + 1, (blocks_per_row,), generator=gen)))
    return out


SLOT_WEIGHTS = ("uniform", "survival")


def slot_weights(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-slot CE weights [B, k]: `uniform` 1; `survival` w_j = prod_{i<j} p_i(y_i), the
    (teacher-forced, detached) probability that every earlier slot is accepted, since a greedy
    walk only reaches slot j through them."""
    if kind == "uniform":
        return torch.ones(labels.shape, device=logits.device)
    if kind != "survival":
        raise ValueError(f"slot weights {kind!r}: expected one of {SLOT_WEIGHTS}")
    p = logits.detach().softmax(-1).gather(-1, labels[..., None])[..., 0]  # [B, k]
    return torch.cat((torch.ones_like(p[:, :1]), p[:, :-1].cumprod(1)), 1)


def drafter_loss(
    model: TrainDrafter, batch: list[tuple[TeacherRow, torch.Tensor]], weights: str = "uniform"
) -> tuple[torch.Tensor, dict]:
    """Weighted mean CE of the Markov-corrected logits (`slot_weights`) + the confidence BCE
    over the batch's blocks."""
    drafter = model.refresh()
    dev, k, win = drafter.device, drafter.k, drafter.window
    kv_parts, valid_parts, anchors, first, labels = [], [], [], [], []
    for row, a in batch:
        n = row.ids.numel()
        kv = drafter.context_kv(row.taps.to(dev), torch.arange(n, device=dev))  # [L, n, d]
        ctx = a[:, None] - win + torch.arange(win)  # [m, W] positions a-W .. a-1
        kv_parts.append(kv[:, ctx.clamp_min(0).to(dev)])  # [L, m, W, d]
        valid_parts.append((ctx >= 0).to(dev))
        anchors.append(row.ids[a])
        first.append(a)
        labels.append(row.greedy[a[:, None] + torch.arange(k)])  # [m, k]
    anchors_t, labels_t = torch.cat(anchors).to(dev), torch.cat(labels).to(dev)
    x, base = drafter.block_pass(
        torch.cat(kv_parts, 1), torch.cat(valid_parts), anchors_t, torch.cat(first).to(dev)
    )  # [B, k, D], [B, k, V]
    prev = torch.cat((anchors_t[:, None], labels_t[:, :-1]), 1)  # [B, k] teacher-forced
    logits = base + drafter.markov_bias(prev.reshape(-1)).reshape(base.shape)
    w = slot_weights(logits, labels_t, weights)  # [B, k]
    ce_all = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels_t.reshape(-1), reduction="none")
    ce = (w.reshape(-1) * ce_all).sum() / w.sum()
    hit = (logits.argmax(-1) == labels_t).float()  # [B, k]
    conf = drafter.confidence(x.detach(), prev).clamp(1e-6, 1 - 1e-6)
    bce = F.binary_cross_entropy(conf, hit)
    return ce + bce, {"ce": ce.item(), "bce": bce.item(), "top1": hit.mean().item()}


# ============================================================================ export
def export_drafter(model: TrainDrafter, base_dir: str, out_dir: str, max_shard_bytes: int) -> list[str]:
    """The base checkpoint plus the drafter's `mtp.*` shards, merged index, drafter config."""
    cfg = model.cfg
    specs = drafter_manifest(cfg)
    tensors = export_tensors(cfg, specs, model.raw, model.formats)
    os.makedirs(out_dir, exist_ok=True)
    index = _copy_backbone(base_dir, out_dir)
    from safetensors.torch import save_file

    shards = plan_shards(specs, max_shard_bytes)
    files = shard_file_names("drafter", len(shards))
    for file, names in zip(files, shards, strict=True):
        save_file({n: tensors[n] for n in names}, os.path.join(out_dir, file), metadata={"format": "pt"})
        index["weight_map"].update({n: file for n in names})
    index["metadata"]["total_size"] = sum(s.nbytes for s in checkpoint_manifest(cfg).values())
    write_index_and_config(out_dir, cfg, index)
    return [os.path.join(out_dir, f) for f in files]


def _copy_backbone(base_dir: str, out_dir: str) -> dict:
    """Copy the base's shards and tokenizer, dropping any `mtp.*` tensor (a previous drafter)
    -> the base index without them."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(base_dir, INDEX_FILE)) as f:
        index = json.load(f)
    old = {n for n in index["weight_map"] if n.startswith("mtp.")}
    for file in sorted(set(index["weight_map"].values())):
        src, dst = os.path.join(base_dir, file), os.path.join(out_dir, file)
        if any(index["weight_map"][n] == file for n in old):
            kept = {n: t for n, t in load_file(src).items() if not n.startswith("mtp.")}
            if kept:
                save_file(kept, dst, metadata={"format": "pt"})
        else:
            shutil.copyfile(src, dst)
    if os.path.exists(os.path.join(base_dir, "tokenizer.json")):
        shutil.copyfile(os.path.join(base_dir, "tokenizer.json"), os.path.join(out_dir, "tokenizer.json"))
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n not in old}
    index["metadata"] = {"total_size": 0}  # recomputed by the caller's manifest
    return index


# ============================================================================ acceptance
@torch.no_grad()
def greedy_continuation(target: Model, prompt: Sequence[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The backbone's greedy continuation (new_tokens ids after the prompt) and the tap rows of
    every position it computed [len(prompt) + new_tokens - 1, n_taps*D]."""
    state = target.new_state()
    ids = torch.tensor(list(prompt), dtype=torch.long, device=target.device)
    logits, taps = target.forward_taps(ids, [SeqInput(state, 0, len(prompt))])
    chain, rows = [int(logits[0][-1].argmax())], [taps.of(0)[0]]
    while len(chain) < new_tokens:
        step = torch.tensor([chain[-1]], device=target.device)
        logits, taps = target.forward_taps(step, [SeqInput(state, state.num_tokens, 1)])
        chain.append(int(logits[0][-1].argmax()))
        rows.append(taps.of(0)[0])
    return chain, torch.cat(rows)


@torch.no_grad()
def speculative_walk(drafter: DSparkDrafter, prompt_len: int, chain: list[int], taps: torch.Tensor) -> tuple[int, int]:
    """Greedy speculative decoding over a known greedy chain -> (steps, tokens emitted).

    chain[i] sits at position prompt_len + i; taps[q] is the tap row of position q. Each step
    drafts k from the anchor chain[i], accepts the prefix equal to chain[i+1 ..], emits it plus
    the bonus, and commits the anchor and the accepted drafts to the windows."""
    state, k = drafter.new_state(), drafter.k
    drafter.insert_context([state], [list(range(prompt_len))], taps[:prompt_len])
    i, steps, emitted = 0, 0, 0
    while i + k < len(chain):  # the chain covers every draft this step can be judged on
        pos = prompt_len + i
        out = drafter.draft([state], torch.tensor([chain[i]]), [pos], greedy_choose)
        drafts = out.tokens[0].tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == chain[i + 1 + accepted]:
            accepted += 1
        steps, emitted, i = steps + 1, emitted + accepted + 1, i + accepted + 1
        if pos + accepted >= taps.shape[0]:  # every draft accepted up to the chain's last token,
            break  # which has no tap row: nothing is left to draft
        committed = list(range(pos, pos + accepted + 1))  # the anchor and accepted drafts
        drafter.insert_context([state], [committed], taps[pos : pos + accepted + 1])
    return steps, emitted


def acceptance_length(target: Model, drafter: DSparkDrafter, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict:
    """AL = tokens emitted per verify step at k drafts, greedy, over the prompts."""
    steps = emitted = 0
    for prompt in prompts:
        chain, taps = greedy_continuation(target, prompt, new_tokens)
        s, e = speculative_walk(drafter, len(prompt), chain, taps)
        steps, emitted = steps + s, emitted + e
    return {
        "acceptance_length": emitted / max(steps, 1),
        "steps": steps,
        "emitted": emitted,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "drafts": drafter.k,
    }


# ============================================================================ the command
def load_frozen_backbone(base_dir: str, preset: str, device: str = "cpu") -> tuple[Model, ModelConfig]:
    """The base checkpoint's backbone (FP32) recording the tap of the preset's drafter keys."""
    from flashpd.model.presets import preset_config

    ckpt = load_checkpoint(base_dir, device=device)
    drafter_keys = preset_config(preset).dspark
    if drafter_keys is None:
        raise ValueError(f"preset {preset!r} has no drafter keys")
    cfg = ckpt.cfg.replace(dspark=drafter_keys)
    target = Model.from_checkpoint(dataclasses.replace(ckpt, cfg=cfg), torch.float32)
    return target, cfg


def train_drafter(args) -> dict:
    from flashpd.model import train_data
    from flashpd.model.train import prepare_data

    log = print if not args.quiet else (lambda *a, **k: None)
    torch.manual_seed(args.seed)
    target, cfg = load_frozen_backbone(args.base, args.preset, str(args.device))
    tok_path = os.path.join(args.base, "tokenizer.json")
    tr_rows, he_rows = prepare_data(tok_path, args.seq_len, args.limit_conversations, log, args.data)
    pad = train_data.PAD_TOKEN_ID
    gen = torch.Generator().manual_seed(args.seed)
    rows = build_teacher_rows(args, target, tr_rows, pad, gen, log)
    model = TrainDrafter(cfg, target, seed=args.seed)
    run = _drafter_loop(args, model, rows, gen, log)
    prompts = _heldout_prompts(he_rows, pad, args.eval_prompts, args.eval_prompt_len)
    return _export_and_evaluate(args, model, target, run, prompts, log)


TEACHER_SOURCES = ("text", "greedy", "mix")


def build_teacher_rows(args, target: Model, tr_rows: torch.Tensor, pad: int, gen: torch.Generator, log):
    """args.teacher_rows rows from random training rows: ShareGPT text labelled by the backbone
    (`text`), prompts + the backbone's greedy continuation (`greedy`), or both (`mix`: a
    args.greedy_fraction share greedy)."""
    if args.teacher_source not in TEACHER_SOURCES:
        raise ValueError(f"--teacher-source {args.teacher_source!r}: expected one of {TEACHER_SOURCES}")
    share = {"text": 0.0, "greedy": 1.0, "mix": args.greedy_fraction}[args.teacher_source]
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--greedy-fraction must be in [0, 1], got {share}")
    order = torch.randperm(tr_rows.shape[0], generator=gen)
    n_greedy = round(share * args.teacher_rows)
    n_text = args.teacher_rows - n_greedy
    rows = teacher_rows(target, tr_rows[order[:n_text]], pad, log=log) if n_text else []
    if n_greedy:
        spec = greedy_spec(args)
        prompts = greedy_prompts(tr_rows[order[n_text:]], pad, n_greedy, spec, gen)
        rows += greedy_teacher_rows(target, prompts, spec, _generator(args, target, log), log)
    return rows


def greedy_spec(args) -> GreedySpec:
    new = args.greedy_tokens if args.greedy_tokens else args.seq_len - args.prompt_max
    return GreedySpec(args.prompt_min, args.prompt_max, new, args.decode_batch)


def _generator(args, target: Model, log):
    """Who generates the greedy tokens: `reference` = the FP32 target itself (dense states; its
    per-sequence Python loops cost ~1,000 torch ops per token: fine on the CPU, minutes per 10^4
    tokens on a GPU), `gpu` = the serving `GpuModel` (batched Triton kernels, decode CUDA graphs,
    BF16, paged states), `auto` = gpu on a CUDA device. Taps and labels stay the FP32 target's."""
    kind = args.greedy_generator
    if kind == "auto":
        kind = "gpu" if str(args.device).startswith("cuda") else "reference"
    if kind == "reference":
        return None
    if kind != "gpu":
        raise ValueError(f"--greedy-generator {kind!r}: expected auto, reference or gpu")
    from flashpd.engine.gpu.loading import load_gpu_model

    t0 = time.time()
    # no load-time warm-up (its 8K-row prefill and 4K-context decode shapes are a server's):
    # the kernels compile at their first call here, for the shapes generation uses
    model = load_gpu_model(args.base, str(args.device), warm=False)
    log(f"greedy generator: GpuModel loaded ({time.time() - t0:.0f} s)")
    return model, lambda lengths: paged_states(model, lengths)


@dataclass
class _DrafterRun:
    steps: int
    train_seconds: float
    history: list[dict]  # {"step", "ce", "bce", "top1"} on logged steps


def _drafter_loop(args, model: TrainDrafter, rows: list, gen: torch.Generator, log) -> _DrafterRun:
    """Run until args.steps or args.minutes over random blocks of the teacher rows."""
    opt = _optimizer(model, args.lr)
    budget = args.minutes * 60.0 if args.minutes else None
    t0, step, history = time.time(), 0, []
    while True:
        elapsed = time.time() - t0
        if (args.steps and step >= args.steps) or (budget and elapsed >= budget):
            return _DrafterRun(steps=step, train_seconds=time.time() - t0, history=history)
        lr = _set_lr(opt, args, step, step / args.steps if args.steps else elapsed / budget)
        idx = torch.randint(0, len(rows), (args.batch,), generator=gen).tolist()
        batch = block_batch([rows[i] for i in idx], args.blocks_per_row, model.drafter.k, gen)
        parts = _drafter_step(model, opt, batch, args.slot_weights)
        step += 1
        if step % args.log_every == 0 or step == 1:
            history.append({"step": step, **parts})
            log(
                f"step {step} ce {parts['ce']:.3f} top1 {parts['top1']:.3f} "
                f"bce {parts['bce']:.3f} lr {lr:.2e} {time.time() - t0:.0f} s",
                flush=True,
            )


def _set_lr(opt: torch.optim.Optimizer, args, step: int, frac: float) -> float:
    """Warmup then cosine to 0.1 x args.lr, scaled per group by its `lr_scale`; returns the base rate."""
    lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))
    for g in opt.param_groups:
        g["lr"] = lr * g["lr_scale"]
    return lr


def _drafter_step(model: TrainDrafter, opt: torch.optim.Optimizer, batch, weights: str) -> dict[str, float]:
    opt.zero_grad(set_to_none=True)
    loss, parts = drafter_loss(model, batch, weights)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return parts


def _export_and_evaluate(args, model: TrainDrafter, target, run: _DrafterRun, prompts, log) -> dict:
    """Export next to the base, reload as served, measure held-out acceptance length, write the log."""
    files = export_drafter(model, args.base, args.out, args.max_shard_bytes)
    served = load_checkpoint(args.out)
    drafter = DSparkDrafter.from_checkpoint(served, target)
    al = acceptance_length(target, drafter, prompts, args.eval_tokens)
    log(f"trained {run.steps} steps in {run.train_seconds:.0f} s; held-out acceptance length {al}")
    result = {
        "steps": run.steps,
        "train_seconds": run.train_seconds,
        "history": run.history,
        "heldout": al,
        "files": files,
    }
    with open(os.path.join(args.out, "drafter_train_log.json"), "w") as f:
        json.dump({k: v for k, v in result.items() if k != "files"}, f, indent=2)
    return result


# The confidence head reads the pre-norm hidden (|x| grows with sqrt(D)): at the drafter's
# learning rate its logits saturate within a few hundred steps (held BCE above ln 2 on `small`);
# a smaller rate keeps it a calibrated probability.
CONFIDENCE_LR_SCALE = 0.02


def _optimizer(model: TrainDrafter, lr: float) -> torch.optim.Optimizer:
    conf = [p for k, p in model.params.items() if "confidence_head" in k]
    rest = [p for k, p in model.params.items() if "confidence_head" not in k]
    return torch.optim.AdamW(
        [{"params": rest, "lr_scale": 1.0}, {"params": conf, "lr_scale": CONFIDENCE_LR_SCALE}],
        lr=lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )


def _heldout_prompts(rows: torch.Tensor, pad: int, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` held-out rows that are that long."""
    out = []
    for r in rows:
        ids = r[r != pad].tolist()
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == count:
            break
    return out
