"""Engram n-gram hashing (model_spec §8.1-§8.4): compressed vocabulary, multipliers, primes, ids.

Per Engram layer L and token position p (history by absolute position):

    t_k = c(token[p-k]) for k = 0..3, or the pad id pi = c(pad) once p-k < 0
    R_1 = t_0*mu_0 ^ t_1*mu_1,  R_2 = R_1 ^ t_2*mu_2,  R_3 = R_2 ^ t_3*mu_3      (int64)
    id[(n-2)*heads + h] = R_{n-1} mod P[n][h] + offset[(n-2)*heads + h]

c is the compressed token map built from the tokenizer (§8.1), mu the odd multipliers drawn from
NumPy's PCG64 stream (§8.2), P the per-column primes and offsets the running sums of the primes of
the earlier columns (§8.3). Products c*mu stay below 2^63 because mu < 2 * floor((2^63-1)/V / 2)
for compressed vocabulary size V.

Presets without a tokenizer (`bench`) use the identity map c(t) = t with V = vocab_size.
Text-only: no token is DEAD (image tokens / padding), so blocking happens only at sequence start.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from flashpd.model.config import ModelConfig

INT63_MAX = 2**63 - 1
_MULTIPLIER_SEED = 10007
_SENTINEL = "\ue000"  # private-use stand-in for a lone space while stripping (§8.1)


# ============================================================================ §8.1 vocabulary
def _key_normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_vocab(tokenizer) -> np.ndarray:
    """Compressed id c(t) for every token id t of a `tokenizers.Tokenizer` (int64 [vocab]).

    Keys: decode([t]) with special tokens kept; a decode containing U+FFFD (a partial UTF-8
    byte token) uses the raw token string instead; otherwise the normalised text (or the text
    itself when normalisation empties it). Ids are assigned in first-appearance order.
    """
    normalizer = _key_normalizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    key_to_id: dict[str, int] = {}
    out = np.empty(vocab_size, dtype=np.int64)
    for t in range(vocab_size):
        text = tokenizer.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(t)
        else:
            key = normalizer.normalize_str(text) or text
        out[t] = key_to_id.setdefault(key, len(key_to_id))
    return out


def compressed_vocab_size(compressed_map: np.ndarray) -> int:
    return int(compressed_map.max()) + 1


# ============================================================================ §8.2 multipliers
def multiplier_bound(compressed_vocab_size: int) -> int:
    """B = floor(floor((2^63-1) / V) / 2): odd multipliers 2v+1 < 2B+2 keep c*mu < 2^63."""
    return (INT63_MAX // compressed_vocab_size) // 2


def multipliers(layer_id: int, compressed_vocab_size: int) -> np.ndarray:
    """The 4 odd int64 hash multipliers of Engram layer `layer_id` (one per shift k = 0..3)."""
    rng = np.random.default_rng(_MULTIPLIER_SEED * layer_id)
    draws = rng.integers(0, multiplier_bound(compressed_vocab_size), size=4)
    return (draws * 2 + 1).astype(np.int64)


# ============================================================================ §8.3 primes
def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _next_unused_prime(after: int, used: set[int]) -> int:
    candidate = after + 1
    while not _is_prime(candidate) or candidate in used:
        candidate += 1
    return candidate


def layer_primes(cfg: ModelConfig) -> list[list[int]]:
    """Per Engram layer (in engram_layer_ids order), the prime of each hash column.

    Column col = (n-2)*heads + head. For each (layer, n) the search restarts at
    engram_vocab_size - 1, and every prime ever handed out (any layer, any n) is skipped.
    """
    used: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        columns = []
        for _n in range(2, cfg.engram_max_ngram_size + 1):
            previous = cfg.engram_vocab_size - 1
            for _head in range(cfg.engram_n_heads):
                previous = _next_unused_prime(previous, used)
                used.add(previous)
                columns.append(previous)
        out.append(columns)
    return out


def column_offsets(primes: list[int]) -> list[int]:
    """Row offset of each column in the layer's table: the sum of the earlier columns' primes."""
    offsets, total = [], 0
    for p in primes:
        offsets.append(total)
        total += p
    return offsets


# ============================================================================ derived config
def fill_derived_fields(hf: dict[str, Any], tokenizer_path: str | None) -> None:
    """Set text_config.engram_num_embeddings and engram_compressed_vocab_size in place.

    Table rows = sum of each layer's primes; compressed size from the tokenizer, else vocab_size
    (identity map, see module docstring).
    """
    t = hf.get("text_config", hf)
    probe = copy.deepcopy(hf)
    probe_t = probe.get("text_config", probe)
    probe_t["engram_num_embeddings"] = [0] * len(t.get("engram_layer_ids", ()))
    cfg = ModelConfig.from_hf(probe)
    t["engram_num_embeddings"] = [sum(p) for p in layer_primes(cfg)]
    t["engram_compressed_vocab_size"] = compressed_vocab_size(_load_map(cfg, tokenizer_path))


def _load_map(cfg: ModelConfig, tokenizer_path: str | None) -> np.ndarray:
    if tokenizer_path is None:
        return np.arange(cfg.vocab_size, dtype=np.int64)
    from tokenizers import Tokenizer

    return compressed_vocab(Tokenizer.from_file(tokenizer_path))


# ============================================================================ §8.4 hash ids
class EngramHasher:
    """Token ids -> Engram table row ids (offsets included), per Engram layer."""

    def __init__(self, cfg: ModelConfig, compressed_map: np.ndarray):
        if compressed_map.ndim != 1:
            raise ValueError(f"compressed map must be 1-D, got shape {compressed_map.shape}")
        size = compressed_vocab_size(compressed_map)
        if size != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"compressed vocabulary has {size} keys but config "
                f"{cfg.name!r} expects engram_compressed_vocab_size="
                f"{cfg.engram_compressed_vocab_size}; every hash would change"
            )
        # The tokenizer may be shorter than vocab_size (padded embedding); ids are checked
        # against the map, which covers every id the tokenizer can produce.
        self.num_token_ids = int(compressed_map.shape[0])
        self.cfg = cfg
        self.max_shift = cfg.engram_max_ngram_size - 1  # history tokens a hash looks back on
        self.num_columns = cfg.engram_hash_columns
        self.compressed_map = torch.from_numpy(compressed_map.astype(np.int64))
        self.pad_id = int(compressed_map[cfg.engram_pad_token_id])
        self.multipliers = [
            torch.from_numpy(multipliers(layer, size)) for layer in cfg.engram_layer_ids
        ]  # each [max_ngram]
        primes = layer_primes(cfg)
        for i, rows in enumerate(cfg.engram_num_embeddings):
            if sum(primes[i]) != rows:
                raise ValueError(f"engram_num_embeddings[{i}] = {rows} != sum of primes {sum(primes[i])}")
        n_grams = cfg.engram_max_ngram_size - 1
        self.primes = [torch.tensor(p, dtype=torch.int64).reshape(n_grams, -1) for p in primes]
        self.offsets = [torch.tensor(column_offsets(p), dtype=torch.int64).reshape(n_grams, -1) for p in primes]
        self._on_device: dict[str, tuple] = {"cpu": (self.compressed_map, self.multipliers, self.primes, self.offsets)}

    @classmethod
    def from_tokenizer(cls, cfg: ModelConfig, tokenizer_path: str | None) -> EngramHasher:
        """Build from a tokenizer.json (None: identity map, compressed size = vocab_size)."""
        return cls(cfg, _load_map(cfg, tokenizer_path))

    def hash_ids(self, engram_index: int, token_ids: torch.Tensor, history: list[int]) -> torch.Tensor:
        """token_ids [T] (+ up to 3 preceding ids, oldest first) -> row ids [T, C] int64."""
        return self.hash_ids_layers([engram_index], token_ids, history)[0]

    def hash_ids_layers(
        self, engram_indices: Sequence[int], token_ids: torch.Tensor, history: list[int]
    ) -> list[torch.Tensor]:
        """`hash_ids` for several Engram layers at once: the ids are checked and compressed
        once, then hashed with each layer's multipliers and primes -> [T, C] per index."""
        if len(history) > self.max_shift:
            raise ValueError(f"history holds {len(history)} ids; at most {self.max_shift}")
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        ids = torch.cat((torch.tensor(history, dtype=torch.int64), token_ids.to(torch.int64).cpu()))
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.num_token_ids):
            raise ValueError(f"token id outside [0, {self.num_token_ids})")
        shifted = self._shifted_compressed(ids, len(history))  # [T, max_shift+1]
        consts = self._constants(shifted.device)
        return [self._rows(consts, index, shifted).to(token_ids.device) for index in engram_indices]

    def hash_windows(self, engram_indices: Sequence[int], windows: torch.Tensor) -> list[torch.Tensor]:
        """windows [T, max_shift+1] int64: each row a token id and the max_shift ids before
        it, oldest first (a full lookback) -> row ids [T, C] per Engram layer index, computed
        on windows' device with no host copy (a decode row whose id is still on the device);
        the compressed ids are looked up once for every layer. Ids are not checked here (they
        come from the model's own samples): an id outside the compressed map (a padded
        vocabulary row) hashes as the pad id, where `hash_ids` raises."""
        if windows.ndim != 2 or windows.shape[1] != self.max_shift + 1:
            raise ValueError(f"windows must be [T, {self.max_shift + 1}], got {tuple(windows.shape)}")
        consts = self._constants(windows.device)
        ids = windows.flip(1)  # column k: token[p-k]
        inside = (ids >= 0) & (ids < self.num_token_ids)
        shifted = torch.where(inside, consts[0][ids.clamp(0, self.num_token_ids - 1)], self.pad_id)
        return [self._rows(consts, index, shifted) for index in engram_indices]

    def _constants(self, device: torch.device) -> tuple:
        """(compressed map, multipliers, primes, offsets) on `device` (cached per device)."""
        key = str(device)
        cached = self._on_device.get(key)
        if cached is None:
            cached = (
                self.compressed_map.to(device),
                [m.to(device) for m in self.multipliers],
                [p.to(device) for p in self.primes],
                [o.to(device) for o in self.offsets],
            )
            self._on_device[key] = cached
        return cached

    def _rows(self, consts: tuple, engram_index: int, shifted: torch.Tensor) -> torch.Tensor:
        """shifted [T, max_shift+1] compressed ids (column k: k tokens back) -> row ids [T, C]."""
        _, multipliers, primes, offsets = consts
        products = shifted * multipliers[engram_index]  # [T, K], < 2^63 by the multiplier bound
        rolling = products[:, :1]
        hashes = []
        for k in range(1, self.max_shift + 1):
            rolling = torch.bitwise_xor(rolling, products[:, k : k + 1])
            hashes.append(rolling)
        r = torch.cat(hashes, dim=1)  # [T, n_grams]: R_{n-1} for n = 2..max_ngram
        # [T, n_grams, H] with the layer's primes and column offsets [n_grams, H]
        row_ids = torch.remainder(r.unsqueeze(-1), primes[engram_index]) + offsets[engram_index]
        return row_ids.reshape(shifted.shape[0], self.num_columns)

    def _shifted_compressed(self, ids: torch.Tensor, n_history: int) -> torch.Tensor:
        """[T, max_shift+1]: column k holds c(token[p-k]), or the pad id before the sequence."""
        compressed = self.compressed_map[ids]
        padded = torch.cat((torch.full((self.max_shift,), self.pad_id, dtype=torch.int64), compressed))
        start = self.max_shift + n_history  # index of token_ids[0] in `padded`
        n_tokens = ids.numel() - n_history
        positions = torch.arange(n_tokens) + start
        shifts = torch.arange(self.max_shift + 1)
        return padded[positions.unsqueeze(1) - shifts.unsqueeze(0)]
