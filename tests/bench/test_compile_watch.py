"""CompileWatch: the Triton hooks it installs record each variant compiled inside the block."""

from triton import knobs

from flashpd.bench.compile_watch import CompileWatch


class _Kernel:  # the hook's `fn` (triton's JitFunctionInfo): a name and the JIT function
    name = "_gemm_kernel"

    class jit_function:
        arg_names = ["x", "w", "BLOCK_N", "SPLIT"]


def _compile(watch_clock, seconds, constants, attrs=None):
    kw = dict(
        key=("sig", str(constants)),
        repr="",
        fn=_Kernel,
        compile={
            "constants": constants,
            "configs": [attrs or {}],
            "signature": {"x": "*bf16", "w": "*fp8e4nv", "BLOCK_N": "constexpr", "SPLIT": "constexpr"},
        },
        is_manual_warmup=False,
        already_compiled=False,
    )
    assert knobs.runtime.jit_cache_hook(**kw) is None  # None: triton goes on compiling
    watch_clock[0] += seconds
    knobs.runtime.jit_post_compile_hook(**kw)


def test_records_each_variant_with_its_constexprs_and_seconds():
    now = [10.0]
    with CompileWatch(clock=lambda: now[0]) as watch:
        _compile(now, 1.5, {(2,): 64, (3,): True})
        _compile(now, 0.25, {(2,): 128, (3,): False})
    s = watch.summary()
    assert s["count"] == 2 and s["seconds"] == 1.75
    assert s["kernels"][0] == {
        "kernel": "_gemm_kernel",
        "seconds": 1.5,
        "constants": {"BLOCK_N": 64, "SPLIT": True},
        "div16": [],
    }
    assert s["kernels"][1]["constants"] == {"BLOCK_N": 128, "SPLIT": False}
    assert "2 Triton compiles, 1.75 s" in watch.report()


def test_hooks_are_restored_and_chained():
    seen = []
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        now = [0.0]
        with CompileWatch(clock=lambda: now[0]) as watch:
            _compile(now, 1.0, {})
        assert seen == ["_gemm_kernel"] and watch.summary()["count"] == 1
        assert knobs.runtime.jit_cache_hook is before[0]
        knobs.runtime.jit_post_compile_hook(key=1, fn=_Kernel, compile={})  # the earlier hook only
        assert seen == ["_gemm_kernel", "_gemm_kernel"] and watch.summary()["count"] == 1
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before


def test_nothing_compiled_is_an_empty_report():
    with CompileWatch() as watch:
        pass
    assert watch.summary() == {"count": 0, "seconds": 0.0, "kernels": []}


class _Sort:
    name = "_sort_pairs_kernel"

    class jit_function:
        arg_names = ["ids", "num_tokens", "max_tiles"]


def test_divisibility_specialisation_of_integer_arguments_is_recorded():
    div = [["tt.divisibility", 16]]
    with CompileWatch(clock=lambda: 0.0) as watch:
        for attrs in ({(0,): div, (1,): div}, {(0,): div}):  # 144 tokens, then 145
            kw = dict(
                key=str(attrs),
                repr="",
                fn=_Sort,
                is_manual_warmup=False,
                already_compiled=False,
                compile={
                    "constants": {},
                    "configs": [attrs],
                    "signature": {"ids": "*i32", "num_tokens": "i32", "max_tiles": "i32"},
                },
            )
            knobs.runtime.jit_cache_hook(**kw)
            knobs.runtime.jit_post_compile_hook(**kw)
    assert [c.div16 for c in watch.compiles] == [("num_tokens",), ()]
    assert "div16=['num_tokens']" in watch.report()
