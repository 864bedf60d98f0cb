"""Which Triton kernels compile (or load from the disk cache) while a block of code runs.

    with CompileWatch() as watch:
        engine.step()
    print(watch.report())

Triton calls `knobs.runtime.jit_cache_hook` before it compiles a specialisation that is not in
the process's kernel cache and `jit_post_compile_hook` after, so each pair is one variant made
during the block: its kernel, its constexprs, the integer arguments it specialised as divisible
by 16 (two calls whose only difference is that compile twice) and the seconds between the two
hooks. A warm-up
that covers the serving shapes leaves nothing to record on the first request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Compile:
    kernel: str
    constants: dict
    seconds: float
    div16: tuple[str, ...] = ()  # integer arguments specialised as divisible by 16


@dataclass
class CompileWatch:
    clock: object = time.perf_counter
    compiles: list[Compile] = field(default_factory=list)
    _open: dict = field(default_factory=dict)
    _saved: tuple | None = None

    # ------------------------------------------------------------------ the hooks
    def before(self, *, key, fn, compile, **_) -> None:
        """jit_cache_hook: a variant is about to be compiled (None: go on compiling)."""
        self._open[(fn.name, str(key))] = self.clock()
        return None

    def after(self, *, key, fn, compile, **_) -> None:
        """jit_post_compile_hook: the variant opened by `before` is ready."""
        start = self._open.pop((fn.name, str(key)), None)
        seconds = 0.0 if start is None else self.clock() - start
        names = getattr(getattr(fn, "jit_function", None), "arg_names", ())
        constants = {_name(k, names): v for k, v in (compile.get("constants") or {}).items()}
        self.compiles.append(Compile(fn.name, constants, seconds, _div16(compile, names)))
        return None

    # ------------------------------------------------------------------ install
    def __enter__(self) -> CompileWatch:
        from triton import knobs

        rt = knobs.runtime
        self._saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        rt.jit_cache_hook = _chain(self.before, self._saved[0])
        rt.jit_post_compile_hook = _chain(self.after, self._saved[1])
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved

    # ------------------------------------------------------------------ results
    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.compiles)

    def summary(self, top: int = 12) -> dict:
        """{"count", "seconds", "kernels": [{"kernel", "seconds", "constants"}, ...]} (slowest
        first, at most `top`)."""
        rows = sorted(self.compiles, key=lambda c: -c.seconds)[:top]
        return {
            "count": len(self.compiles),
            "seconds": round(self.seconds, 3),
            "kernels": [
                {
                    "kernel": c.kernel,
                    "seconds": round(c.seconds, 3),
                    "constants": {k: v for k, v in c.constants.items() if isinstance(v, (int, float, bool, str))},
                    "div16": list(c.div16),
                }
                for c in rows
            ],
        }

    def report(self, top: int = 12) -> str:
        s = self.summary(top)
        lines = [f"{s['count']} Triton compiles, {s['seconds']:.2f} s"]
        lines += [f"  {k['seconds']:7.3f} s  {k['kernel']}  {k['constants']}  div16={k['div16']}" for k in s["kernels"]]
        return "\n".join(lines)


def _name(key, names) -> str:
    """A constexpr's key in the hook's `constants` (a path of argument indices) as its name."""
    if isinstance(key, tuple) and key and isinstance(key[0], int) and key[0] < len(names):
        return ".".join([names[key[0]], *map(str, key[1:])])
    return ".".join(map(str, key)) if isinstance(key, tuple) else str(key)


def _div16(compile: dict, names) -> tuple[str, ...]:
    """The integer arguments Triton specialised as divisible by 16 (its `attrs`: an argument
    path -> [["tt.divisibility", 16]]; pointers, nearly always aligned, left out)."""
    attrs = (compile.get("configs") or [{}])[0] or {}
    signature = compile.get("signature") or {}
    out = []
    for path, values in attrs.items():
        if not any(v and v[0] == "tt.divisibility" for v in values):
            continue
        name = _name(path, names)
        if not str(signature.get(name, "")).startswith("*"):
            out.append(name)
    return tuple(sorted(out))


def _chain(mine, theirs):
    if theirs is None:
        return mine

    def both(**kwargs):
        mine(**kwargs)
        return theirs(**kwargs)

    return both
