"""The CPU step without PyTorch glue (issue 30): the compiled layer ops round as PyTorch's ops round, the merged
QKV projection is the three projections, and the step program (``model/step_program.py``) gives the modules' own
numbers bit for bit — padded to a row bucket or not, with long prefills on SDPA or not, after a weight changes —
and stands aside when a learner's attention kernel is plugged in, or for a bf16 model where the CPU's oneDNN has
no bf16 GEMMs (an AVX2-only CPU). The compiled ops are tested in every build of the kernel this CPU can run (native,
AVX-512, AVX2, baseline x86-64: ``test_cpu_kernel.use_build``)."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernel import use_build
from test_kernels import TOL

from minipaged import hooks, profiling
from minipaged.kernels import cpu_kernel
from minipaged.kernels import torch_backend as TB
from minipaged.model import AttentionMetadata, LlamaForCausalLM, layers, step_program
from minipaged.model.layers import Linear, MergedLinear, OneDNNOps, RMSNorm, RotaryEmbedding, onednn_ops, packed_rows
from minipaged.model.step_program import StepProgram, onednn_runs
from minipaged.model_loader import save_tiny_llama

needs_kernel = pytest.mark.skipif(
    cpu_kernel.unavailable_reason() is not None,
    reason=f"the CPU kernel cannot be built here: {cpu_kernel.unavailable_reason()}",
)
needs_onednn = pytest.mark.skipif(onednn_ops() is None, reason="no oneDNN packed linear in this PyTorch build")
DTYPES = [torch.float32, torch.bfloat16]
TARGETS = cpu_kernel.targets()  # native, then each x86-64 level (skipped, saying why, where the CPU lacks it)


@needs_kernel
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_is_pytorchs_rmsnorm(dtype, target, monkeypatch):
    """bf16: bit for bit (every rounding where PyTorch's ops round). fp32: the sum of squares is added in another
    order, so the last bit may differ; nothing more."""
    use_build(target, monkeypatch)
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
        x = (torch.randn(37, 700, generator=g) * 3).to(dtype)[:, 50:626]  # rows 700 apart: a slice is fine
        ours = cpu_kernel.rms_norm(x, norm.weight, norm.eps)
        dtype_ = x.float()
        want = norm.weight * (dtype_ * torch.rsqrt(dtype_.pow(2).mean(-1, keepdim=True) + norm.eps)).to(dtype)
    assert ours.dtype == dtype and ours.shape == (37, 576)
    if dtype == torch.bfloat16:
        assert torch.equal(ours, want)
    else:
        torch.testing.assert_close(ours, want, rtol=2e-7, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(norm(x), ours)  # the module takes the compiled path under no_grad on a CPU
    assert norm(x).requires_grad  # with autograd on it stays PyTorch's ops, which autograd can follow


@needs_kernel
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_and_cache_is_rotary_embedding_then_the_write(dtype, target, monkeypatch):
    use_build(target, monkeypatch)
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, n = 9, 3, 64, 21
    cos, sin = RotaryEmbedding(d, 100000.0)(torch.randint(0, 3000, (n,), generator=g), dtype)
    qkv = torch.randn(n + 3, (hq + 2 * hkv) * d, generator=g).to(dtype)  # 3 padding rows after the step's 21
    kc = torch.full((8, 16, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    slots = torch.randperm(128, generator=g)[:n]
    slots[4] = -1  # padding: nothing written
    q = cpu_kernel.rope_and_cache(qkv, cos, sin, kc, vc, slots, hq)
    q_want = RotaryEmbedding.apply(qkv[:n, : hq * d].reshape(n, hq, d), cos, sin)
    k_want = RotaryEmbedding.apply(qkv[:n, hq * d : (hq + hkv) * d].reshape(n, hkv, d), cos, sin)
    v_want = qkv[:n, (hq + hkv) * d :].reshape(n, hkv, d)
    assert torch.equal(q[:n], q_want) and not q[n:].any()  # padding rows: zeros
    written = slots >= 0
    assert torch.equal(kc.view(-1, hkv, d)[slots[written]], k_want[written])
    assert torch.equal(vc.view(-1, hkv, d)[slots[written]], v_want[written])
    assert int((~kc.view(-1, hkv * d).isnan().all(-1)).sum()) == n - 1  # no other slot touched


def test_merged_linear_is_the_separate_projections_and_follows_their_weights():
    torch.manual_seed(2)
    parts = [torch.nn.Linear(32, m, bias=True) for m in (48, 16, 16)]
    lins = []
    for p in parts:
        lin = Linear(32, p.out_features, bias=True)
        lin.load_state_dict(p.state_dict())
        lins.append(lin)
    merged = MergedLinear(*lins)
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), torch.cat([lin(x) for lin in lins], dim=1))
        lins[1].weight.mul_(2)  # a weight changes in place: the stacked copy is made again
        torch.testing.assert_close(merged(x), torch.cat([lin(x) for lin in lins], dim=1))
    holder = torch.nn.Module()
    holder.merged = merged  # a plain object: no parameters, nothing in a state dict
    assert not list(holder.parameters()) and not holder.state_dict()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small Llama with SmolLM2's head_dim (64, so the kernel's AVX-512 tile runs where there is one) and GQA."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("step-program-llama"),
        num_attention_heads=3,
        num_key_value_heads=1,
        hidden_size=192,
        intermediate_size=320,
        vocab_size=256,
        num_hidden_layers=3,
    )


def mixed_step(block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A 40-row prefill chunk (after 8 cached tokens), a 3-row chunk and decodes: 45 rows, padded to 48."""
    q_lens, seq_lens = [40, 3, 1, 1], [48, 3, 70, 17]
    tables, next_block = [], 1
    for n in seq_lens:
        k = -(-n // block_size)
        tables.append(list(range(next_block, next_block + k)) + [0] * (5 - k))
        next_block += k
    slots, positions = [], []
    for table, q, n in zip(tables, q_lens, seq_lens):
        for p in range(n - q, n):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        max_query_len=max(q_lens),
    )
    ids = torch.randint(0, 256, (len(slots),), generator=torch.Generator().manual_seed(5))
    return ids, torch.tensor(positions), meta


def run_step(model: LlamaForCausalLM, program: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixed step on fresh caches whose context was filled by the same path: (hidden states, the K cache)."""
    caches = [(torch.zeros(20, 16, 1, 64, dtype=dtype), torch.zeros(20, 16, 1, 64, dtype=dtype)) for _ in range(3)]
    model.model._program = None if program else False
    ids, positions, meta = mixed_step()
    with torch.inference_mode():
        # First the context: every token before the step's, through the same path.
        ctx_ids, ctx_pos, ctx_meta = context_of(meta)
        model(ctx_ids, ctx_pos, caches, ctx_meta)
        hidden = model(ids, positions, caches, meta)
    return hidden, torch.stack([k for k, _ in caches])


def context_of(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A prefill of every token the step's sequences hold before the step (their cached context)."""
    cu = meta.cu_seqlens_q.tolist()
    starts = [int(n) - (cu[i + 1] - cu[i]) for i, n in enumerate(meta.seq_lens.tolist())]
    slots, positions, new_cu = [], [], [0]
    for table, start in zip(meta.block_tables.tolist(), starts):
        for p in range(start):
            positions.append(p)
            slots.append(table[p // 16] * 16 + p % 16)
        new_cu.append(new_cu[-1] + start)
    lens = list(starts)
    keep = [i for i, s in enumerate(lens) if s > 0]
    ctx = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=meta.block_tables[keep],
        seq_lens=torch.tensor([lens[i] for i in keep], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0] + [new_cu[i + 1] for i in keep], dtype=torch.int32),
        max_query_len=max(lens),
    )
    ids = torch.randint(0, 256, (len(slots),), generator=torch.Generator().manual_seed(6))
    return ids, torch.tensor(positions), ctx


@needs_kernel
@needs_onednn
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("long_prefill_on_sdpa", [False, True])
def test_the_program_gives_the_modules_numbers_bit_for_bit(model_dir, dtype, long_prefill_on_sdpa, target, monkeypatch):
    """A mixed step of 45 rows (a GEMM bucket of 48: three padding rows) through the program and through the
    modules: the same hidden states and the same cache, to the bit, on every build of the kernel. With a low
    KERNEL_MAX_Q_LEN the 40-row chunk goes to SDPA, and the program takes its unbound path (``attend``). A bf16
    program runs exactly where the CPU's oneDNN has bf16 GEMMs (``onednn_runs``; not on an AVX2-only Zen 3, where
    the modules run it: the branch the next test forces on every machine)."""
    use_build(target, monkeypatch)
    assert packed_rows(45) == 48
    if long_prefill_on_sdpa:
        monkeypatch.setattr(TB, "KERNEL_MAX_Q_LEN", 8)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    runs = []
    spy = []
    real_run = StepProgram.run
    monkeypatch.setattr(StepProgram, "run", lambda self, *a: spy.append(1) or real_run(self, *a))
    for program in (True, False):
        spy.clear()
        runs.append(run_step(model, program, dtype))
        # The program really ran (twice: context, step) where asked and its GEMMs exist; else the modules did.
        assert bool(spy) == (program and onednn_runs(dtype))
    (h1, k1), (h2, k2) = runs
    assert h1.shape == (45, 192) and not h1.isnan().any()
    assert torch.equal(h1, h2) and torch.equal(k1, k2)


BF16_REFUSED = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
)


@needs_kernel
@needs_onednn
@pytest.mark.parametrize("onednn_refuses_bf16", [False, True], ids=["check off", "check off, bf16 GEMMs refused"])
def test_without_onednn_bf16_gemms_a_bf16_model_runs_on_the_modules(
    model_dir, onednn_refuses_bf16, monkeypatch, caplog
):
    """An AVX2-only CPU (a Zen 3) on every machine: ``onednn_runs`` forced to say no bf16 GEMMs. The program stands
    aside for a bf16 model and the modules run it: with oneDNN's bf16 GEMMs still there, to the bit what the CPU's
    own choice gives; with them refused too, as on a Zen 3 (a bf16 reorder raises oneDNN's error; one warning), on
    PyTorch's GEMM, within bf16's rounding. A fp32 model keeps its program."""
    bf16 = torch.bfloat16
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=bf16)
    want, want_k = run_step(model, True, bf16)  # as this CPU decides: the program where it has bf16 GEMMs
    monkeypatch.setattr(step_program, "onednn_runs", lambda dtype: dtype != bf16)
    if onednn_refuses_bf16:
        real = onednn_ops()
        assert real is not None

        def reorder(w: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
            if w.dtype == bf16:
                raise RuntimeError(BF16_REFUSED)
            return real.reorder(w, batch_size_hint)

        monkeypatch.setattr(layers, "_ONEDNN", True)
        monkeypatch.setattr(layers, "_ONEDNN_OPS", OneDNNOps(reorder, real.pointwise, real.binary))
        monkeypatch.setattr(layers, "_ONEDNN_FAILED_DTYPES", set())
        monkeypatch.delitem(cpu_kernel._PRODUCT_BITS, bf16)  # nor has a Zen 3 the bf16 decode products
    ran = []
    real_run = StepProgram.run
    monkeypatch.setattr(StepProgram, "run", lambda self, *a: ran.append(1) or real_run(self, *a))
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=bf16)  # nothing packed yet
    with caplog.at_level("WARNING", logger="minipaged"):
        caplog.clear()  # only what the runs below log
        asked, asked_k = run_step(model, True, bf16)
        modules, modules_k = run_step(model, False, bf16)
    assert not ran and torch.equal(asked, modules) and torch.equal(asked_k, modules_k)
    assert asked.shape == (45, 192) and not asked.isnan().any()
    refused = [r.getMessage() for r in caplog.records if "oneDNN packed linear off for bfloat16" in r.getMessage()]
    if onednn_refuses_bf16:
        assert len(refused) == 1 and BF16_REFUSED in refused[0] and layers._ONEDNN_FAILED_DTYPES == {bf16}
        torch.testing.assert_close(asked, want, **TOL[bf16])
        torch.testing.assert_close(asked_k, want_k, **TOL[bf16])
    else:
        assert not refused and torch.equal(asked, want) and torch.equal(asked_k, want_k)
    run_step(LlamaForCausalLM.from_pretrained(model_dir), True, torch.float32)
    assert ran  # fp32: the program


@needs_kernel
@needs_onednn
def test_the_program_follows_a_weight_change_and_stands_aside_for_a_learners_kernel(model_dir, monkeypatch):
    model = LlamaForCausalLM.from_pretrained(model_dir)
    before, _ = run_step(model, True, torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-1)  # in place: same address, a new version
    after, _ = run_step(model, True, torch.float32)
    modules, _ = run_step(model, False, torch.float32)
    assert not torch.equal(before, after) and torch.equal(after, modules)
    up = model.model.layers[2].mlp.up_proj
    with torch.no_grad():  # a new parameter in its place (same version 0, a new address): the program sees it too
        up.weight = torch.nn.Parameter(up.weight * 0.5, requires_grad=False)
    replaced, _ = run_step(model, True, torch.float32)
    modules, _ = run_step(model, False, torch.float32)
    assert not torch.equal(replaced, after) and torch.equal(replaced, modules)

    from minipaged.kernels import reference

    calls = []

    def learners_write(*args):  # a learner's scatter-write (exercise 05b): the modules' path must run it
        calls.append(1)
        return reference.reshape_and_cache(*args)

    ran = []
    real_run = StepProgram.run
    monkeypatch.setattr(StepProgram, "run", lambda self, *a: ran.append(1) or real_run(self, *a))
    hooks.push({"reshape_and_cache": learners_write})
    try:
        plugged, _ = run_step(model, True, torch.float32)
    finally:
        hooks.pop()
    assert calls and not ran
    torch.testing.assert_close(plugged, modules, rtol=1e-5, atol=1e-5)  # the reference kernels: not bit for bit


@needs_kernel
@needs_onednn
def test_a_built_program_knows_when_its_weights_changed(model_dir):
    """The engine asks ``is_current`` every step instead of rebuilding: an in-place change (a new version), a
    swapped storage (a new address) and a replaced parameter each make it stale, and nothing else does."""
    model = LlamaForCausalLM.from_pretrained(model_dir)
    with torch.inference_mode():
        first = model.model.step_program()
        assert first is not None and first.is_current() and model.model.step_program() is first
        mlp = model.model.layers[0].mlp
        with torch.no_grad():
            mlp.gate_proj.weight.add_(0)  # in place: a new version
        assert not first.is_current()
        second = model.model.step_program()
        assert second is not first and second.is_current()
        mlp.up_proj.weight.data = mlp.up_proj.weight.data.clone()  # a new address
        assert not second.is_current()
        third = model.model.step_program()
        mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach(), requires_grad=False)  # same storage
        assert not third.is_current()
        fourth = model.model.step_program()
        torch.nn.Linear(4, 4)  # another module's parameters: the program is conservative and builds again
        assert fourth.is_current() is False and model.model.step_program().is_current()


@needs_kernel
@needs_onednn
@pytest.mark.parametrize(
    "fast",
    [
        pytest.param(
            True,
            id="fast span",
            marks=pytest.mark.skipif(profiling._FAST is None, reason="this PyTorch has no _RecordFunctionFast"),
        ),
        pytest.param(False, id="record_function"),
    ],
)
def test_a_profile_names_the_model_its_attention_and_its_norms(model_dir, fast, monkeypatch):
    """What ``benchmarks/bench_engine.py`` splits the model's time with: every step a ``model`` span, and inside
    it 2 ``rms_norm`` and 1 ``paged_attention`` span per layer (the compiled calls, invisible to the profiler
    otherwise) next to the GEMMs; with the fast span or, where PyTorch lacks it, the public one."""
    from torch.profiler import ProfilerActivity, profile

    from minipaged import LLM, SamplingParams

    if not fast:
        monkeypatch.setattr(profiling, "_FAST", None)
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    prompts = [[5, 9, 2, 7, 1, 3] * 3, [4, 4, 8]]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    events = prof.events()
    steps = [e for e in events if e.name == "model"]
    assert len(steps) == 3  # one prefill step, two decode steps

    def inside_model(e) -> bool:
        p = e.cpu_parent
        while p is not None and p.name != "model":
            p = p.cpu_parent
        return p is not None

    for name, per_layer in (("rms_norm", 2), ("paged_attention", 1)):
        found = [e for e in events if e.name == name]
        assert len(found) == 3 * 3 * per_layer and all(inside_model(e) for e in found), name
    assert any("linear" in e.name and inside_model(e) for e in events)
    if layers.decode_products_on():  # compiled products name themselves: qkv, o, gate-and-up, down; the head
        products = [e for e in events if e.name == "decode_linear"]
        assert len(products) == 3 * (3 * 4 + 1) and all(inside_model(e) for e in products)


@needs_kernel
@needs_onednn
def test_minipaged_step_program_0_runs_the_modules(model_dir, monkeypatch):
    """The benchmark's lever switch: with MINIPAGED_STEP_PROGRAM=0 the program is not used, and the numbers stay."""
    model = LlamaForCausalLM.from_pretrained(model_dir)
    with_program, _ = run_step(model, True, torch.float32)
    monkeypatch.setenv("MINIPAGED_STEP_PROGRAM", "0")
    ran = []
    real_run = StepProgram.run
    monkeypatch.setattr(StepProgram, "run", lambda self, *a: ran.append(1) or real_run(self, *a))
    with torch.inference_mode():
        assert model.model.step_program() is None
    without, _ = run_step(model, True, torch.float32)
    assert not ran and torch.equal(with_program, without)


def _products_here(dtype: torch.dtype = torch.float32) -> None:
    if not layers.decode_products_on(dtype):
        pytest.skip(f"no {dtype} decode products in this build ({cpu_kernel.describe()}): oneDNN runs every product")


# on against off: fp32 sums in another order; in bf16 also each product's one rounding against oneDNN's (which
# rounds silu(gate) and the product before the multiply), through three layers
_ON_OFF_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


@needs_kernel
@needs_onednn
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_steps_run_on_the_decode_products_and_give_onednns_numbers_to_rounding(model_dir, dtype, monkeypatch):
    """A step of at most PRODUCT_ROWS rows (the 45-row mixed step) runs its products on the compiled decode
    products, in the program and in the modules alike (``Linear.decode_panels``: the bit-for-bit test above
    compares those two); with ``MINIPAGED_DECODE_PRODUCTS=0`` oneDNN does, and the numbers agree to rounding.
    A step past PRODUCT_ROWS runs on oneDNN."""
    _products_here(dtype)
    calls = []
    real = cpu_kernel.decode_product
    monkeypatch.setattr(cpu_kernel, "decode_product", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    on, k_on = run_step(model, True, dtype)
    # building the program runs each merged QKV once on a probe row; then the context and the step: qkv, o and
    # down in each of three layers
    assert len(calls) == 3 + 2 * 3 * 3
    calls.clear()
    monkeypatch.setenv("MINIPAGED_DECODE_PRODUCTS", "0")
    off, k_off = run_step(model, True, dtype)
    assert not calls and not torch.equal(on, off)
    torch.testing.assert_close(on, off, **_ON_OFF_TOL[dtype])
    torch.testing.assert_close(k_on, k_off, **_ON_OFF_TOL[dtype])
    monkeypatch.delenv("MINIPAGED_DECODE_PRODUCTS")
    monkeypatch.setattr(layers, "PRODUCT_ROWS", 44)  # the step's 45 rows are past it now
    monkeypatch.setattr(step_program, "PRODUCT_ROWS", 44)
    past, _ = run_step(model, True, dtype)
    assert len(calls) == 3 and torch.equal(past, off)  # the build's probe rows only


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_linear_takes_the_decode_products_only_where_they_apply(dtype, monkeypatch):
    """The weight's dtype (fp32, or bf16 with an even number of input features: it multiplies pairs), no bias,
    whole 32-column panels, 1 to PRODUCT_ROWS rows, no gradients, switched on; the panels follow the weight.
    Everywhere else, None: the caller multiplies with oneDNN or PyTorch."""
    _products_here(dtype)
    lin = Linear(40, 64, bias=False).to(dtype)
    x = torch.randn(5, 40).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)

    def want(x: torch.Tensor, r: torch.Tensor | float = 0.0) -> torch.Tensor:
        return (x.double() @ lin.weight.double().T + (r.double() if isinstance(r, torch.Tensor) else r)).to(dtype)

    with torch.no_grad():
        panels = lin.decode_panels(x)
        assert panels is not None and lin.decode_panels(x) is panels  # packed once
        assert lin(x).dtype == dtype
        torch.testing.assert_close(lin(x), want(x), **tol)
        lin.weight.mul_(2)
        assert lin.decode_panels(x) is not panels  # a changed weight is packed again
        torch.testing.assert_close(lin(x), want(x), **tol)
        r = torch.randn(5, 64).to(dtype)
        torch.testing.assert_close(lin.add(x, r), want(x, r), **tol)
        assert lin.decode_panels(torch.randn(layers.PRODUCT_ROWS + 1, 40).to(dtype)) is None
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        assert lin.decode_panels(x.to(other)) is None
        assert Linear(40, 64, bias=True).to(dtype).decode_panels(x) is None
        assert Linear(40, 48, bias=False).to(dtype).decode_panels(x) is None  # 48 columns: one and a half panels
        if dtype == torch.bfloat16:
            assert Linear(41, 64, bias=False).to(dtype).decode_panels(torch.randn(5, 41).to(dtype)) is None
        monkeypatch.setenv("MINIPAGED_DECODE_PRODUCTS", "0")
        assert lin.decode_panels(x) is None
    monkeypatch.delenv("MINIPAGED_DECODE_PRODUCTS")
    assert lin.decode_panels(x) is None  # gradients on
