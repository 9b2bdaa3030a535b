"""The pack under ComfyUI's compiler (malloc graphs, ComfyUI 0.34+), modelled on a CPU by `SimMallocGraph`.

Qwen-Image 2.1 runs with the upstream model's own call sequence (a graph begun after `select_prefix_cache`, a
scope per block, the capture's prefix pass paused); FLUX.2, Qwen-Image-Edit and Wan Animate 2 with a graph opened
around their blocks. Two prompts in a row, every mode, CFG on and off, reuse on and off: no failure, no rogue, no
graph break once every branch is cached, and the latents of the run without graphs, and of the model alone.
"""

import sys
import types

import pytest
import torch

from kv_offload_pack.nodes.run import compiler, host as host_mod, wrappers
from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.nodes.run.reuse import ALWAYS, REUSE
from kv_offload_pack.offload_core import HostServices, KVStore

import wan_tiny
from malloc_graph import SimMallocGraph
from nodes_tiny import FakePatcher, FluxKVCacheReference, TinyDiT, sample
from patch_helpers import Recorder, no_files
from qwen21_tiny import Tiny21
from reuse_nodes_helpers import Patcher

MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]
STEPS = 4


class TinyEdit(TinyDiT):
    """Qwen-Image-Edit's seam (`transformer_blocks` and a reference method, no Flux double / single blocks)."""

    def __init__(self):
        super().__init__()
        del self.double_blocks, self.single_blocks
        self.transformer_blocks = [None] * len(self.blocks)


def _inputs(family, seed, cfg):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, 8 if family == "wan" else 6, 32, generator=g)
    c = torch.Generator().manual_seed(7)  # the prompt and reference: the same for both prompts
    n = 2 if cfg else 1
    refs = [torch.randn(1, 8 if family == "wan" else 5, 32, generator=c) for _ in range(n)]
    return noise, refs if family != "wan" else refs[0].expand(1, -1, -1).clone(), [torch.randn(1, 3, 32, generator=c)
                                                                                     for _ in range(2)]


def two_prompts(family, mode, cfg, batched, reuse, tmp_path, sim=None):
    """The latents of two queued prompts (seeds 0 and 1) of `family`; mode None: the model with ComfyUI's own
    cache. `sim`: ComfyUI's compiler, cleaned up between the prompts as ComfyUI does between nodes."""
    dm = {"qwen21": Tiny21, "flux": TinyDiT, "edit": TinyEdit, "wan": wan_tiny.TinyWanAnimate2}[family]()
    def theirs():  # ComfyUI's own caches, one per queued graph: what lossless modes match bit for bit
        if family == "wan":
            return {"transformer_options": {"animate2_cache": wan_tiny.ComfyPoseCache()}}
        return {"transformer_options": FluxKVCacheReference().options() if family in ("flux", "edit") else {}}

    options = None
    if mode is not None:
        host = HostServices(temp_dir=lambda: str(tmp_path), pause_graph=host_mod.pause_graph())
        m, _ = apply_offload(Patcher(dm, {"transformer_options": {}}), config_from_inputs(mode), host=lambda p: host,
                             store_factory=KVStore, reuse=ALWAYS if reuse else False, telemetry=Recorder())
        options = m.options()
        for name, obj in m.object_patches.items():  # what ModelPatcher does while the model is patched
            if name != "diffusion_model.default_ref_method":
                setattr(dm, name.split(".", 1)[1], obj)
    outs = []
    for seed in (0, 1):
        noise, refs, txts = _inputs(family, seed, cfg)
        opts = options or theirs()
        if family == "qwen21":
            dm.reset_prefix_cache(True)  # ModelPatcher.pre_run on the 2.1 model
        try:
            if family == "wan":
                outs.append(wan_tiny.sample(dm, opts, noise, refs, txts, steps=STEPS, cfg=cfg, batched=batched))
            else:
                outs.append(sample(dm, opts, noise, refs, txts, steps=STEPS, cfg=cfg, batched=batched))
        finally:
            if family == "qwen21":
                dm.reset_prefix_cache(False)
            if sim is not None:
                sim.cleanup_prefetch_queues()
    return outs


@pytest.fixture(autouse=True)
def _empty_registry():
    REUSE.reset()
    yield
    REUSE.reset()


def _under_graphs(monkeypatch, family, mode, cfg, batched, reuse, tmp_path):
    sim = SimMallocGraph().install(monkeypatch)
    with sim.recording():
        outs = two_prompts(family, mode, cfg, batched, reuse, tmp_path, sim)
    return outs, sim.totals()


CFG = {"nocfg": (None, True), "cfg": (3.0, True), "cfg-split": (3.0, False)}
# Prefix reuse serves Qwen-Image 2.1 only; the 2.1 model keys its prefix per cond, so its conds run apart.
CASES = [(family, mode, cfg, reuse) for family in ("qwen21", "flux", "edit", "wan") for mode in MODES for cfg in CFG
         for reuse in ((False, True) if family == "qwen21" else (False,)) if not (family == "qwen21" and cfg == "cfg")]


@pytest.mark.parametrize("family, mode, cfg, reuse", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_every_family_and_mode_runs_clean_under_the_compiler(monkeypatch, tmp_path, family, mode, cfg, reuse,
                                                             one_torch_thread):
    cfg, batched = CFG[cfg]
    ours, totals = _under_graphs(monkeypatch, family, mode, cfg, batched, reuse, tmp_path)
    assert totals["failures"] == 0 and totals["rogues"] == 0, totals
    per_step = 2 if cfg and not batched else 1
    assert all(sum(b[2 * per_step:]) == 0 for b in totals["breaks"]), totals  # every branch cached by step 2
    monkeypatch.delitem(sys.modules, "comfy.model_prefetch")
    assert all(torch.equal(a, b) for a, b in zip(ours, two_prompts(family, mode, cfg, batched, reuse, tmp_path)))
    if not (family in ("flux", "edit") and cfg and not batched):  # FluxKVCache keys by block alone, not by cond
        theirs = two_prompts(family, None, cfg, batched, False, tmp_path)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert no_files(tmp_path) == []


@pytest.mark.parametrize("family", ["qwen21", "flux", "wan"])
def test_the_models_run_clean_without_the_pack(monkeypatch, tmp_path, family):
    """The baseline: each tiny model keeps its state in place between blocks, as upstream's do; Qwen-Image 2.1
    with its own cache, the others with none (ComfyUI's FluxKVCache and pose cache keep a tensor made in a block:
    rogues, should their models open a graph)."""
    sim = SimMallocGraph().install(monkeypatch)
    dm = {"qwen21": Tiny21, "flux": TinyDiT, "wan": wan_tiny.TinyWanAnimate2}[family]()
    noise, refs, txts = _inputs(family, 0, 3.0)
    with sim.recording():
        if family == "qwen21":
            dm.reset_prefix_cache(True)
            sample(dm, {"transformer_options": {}}, noise, refs, txts, steps=STEPS, cfg=3.0, batched=False)
        elif family == "wan":
            wan_tiny.sample(dm, {}, noise, refs, txts, steps=STEPS, cfg=3.0, batched=False)
        else:
            sample(dm, {}, noise, refs, txts, steps=STEPS, cfg=3.0, batched=False)
    totals = sim.totals()
    assert totals["failures"] == 0 and totals["rogues"] == 0, totals
    assert all(sum(b[4:]) == 0 for b in totals["breaks"]), totals


def test_the_model_catches_a_tensor_kept_into_the_next_block(monkeypatch):
    """What the pack's Qwen-Image 2.1 cache did before: a stacked copy made in block i, freed in block i + 1."""
    sim = SimMallocGraph().install(monkeypatch)
    mp = sim.module
    with sim.recording(), pytest.raises(RuntimeError, match="aimdo memory compile error"):
        mp.malloc_graph_begin("cpu")
        held = None
        for i in range(3):
            mp.prefetch_queue_pop(None, "cpu", ("block", i), malloc_scope="block")
            held = torch.stack([torch.ones(4), torch.ones(4)])  # frees the one of the block before
    assert sim.totals()["rogues"] >= 1 and held is not None
    sim.cleanup_prefetch_queues()
    with sim.recording():  # paused, the same is no rogue
        mp.malloc_graph_begin("cpu")
        for i in range(3):
            mp.prefetch_queue_pop(None, "cpu", ("block", i), malloc_scope="block")
            with mp.pause_malloc_graph():
                held = torch.stack([torch.ones(4), torch.ones(4)])
        mp.prefetch_queue_pop(None, "cpu", None, malloc_scope="block")
        mp.malloc_graph_end()
    sim.cleanup_prefetch_queues()


def test_the_stores_allocate_under_comfyuis_pause(monkeypatch):
    sim = SimMallocGraph().install(monkeypatch)
    assert host_mod.pause_graph() == sim.pause_malloc_graph
    monkeypatch.delitem(sys.modules, "comfy.model_prefetch")
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    assert host_mod.pause_graph() is None  # ComfyUI v0.33: no compiler


def _flux_noting():
    """(the tiny FLUX model, its patcher in ram_sync, the notes its readout is told)."""
    seen = []
    hub = Recorder()
    hub.note = seen.append
    dm = TinyDiT()
    m, _ = apply_offload(FakePatcher(dm), config_from_inputs("ram_sync"), host=lambda p: HostServices(),
                         store_factory=KVStore, telemetry=hub)
    return dm, m, seen


def _cli_args(monkeypatch, disabled=False):
    args = types.SimpleNamespace(disable_comfy_compiler=disabled)
    cli = types.ModuleType("comfy.cli_args")
    cli.args = args
    monkeypatch.setitem(sys.modules, "comfy.cli_args", cli)
    return args


@pytest.mark.parametrize("pause, aimdo, off", [(True, "0.6.0", False), (False, "0.6.0", True), (True, "0.5.2", True),
                                               (True, None, True)])
def test_the_compiler_is_turned_off_for_our_run_where_the_stores_cannot_stay_out(monkeypatch, tmp_path, pause, aimdo,
                                                                                 off):
    SimMallocGraph(pause=pause).install(monkeypatch)
    args = _cli_args(monkeypatch)
    monkeypatch.setattr(compiler, "aimdo_version", lambda: aimdo)
    dm, m, seen = _flux_noting()
    during = []
    real = dm._forward
    monkeypatch.setattr(dm, "_forward", lambda *a: during.append(args.disable_comfy_compiler) or real(*a))
    noise, refs, txts = _inputs("flux", 0, None)
    sample(dm, m.options(), noise, refs, txts, steps=2)
    assert during == [off, off] and args.disable_comfy_compiler is False  # restored after the run
    assert bool(seen) == off and all("ComfyUI's compiler is off for this run" in s for s in seen)
    if off:
        with pytest.raises(KeyboardInterrupt):  # restored however the run ends
            sample(dm, m.options(), noise, refs, txts, steps=2, fail_at=(0, "cond-uuid"))
        assert args.disable_comfy_compiler is False


def test_a_compiler_the_user_turned_off_stays_off(monkeypatch):
    SimMallocGraph(pause=False).install(monkeypatch)
    args = _cli_args(monkeypatch, disabled=True)
    with compiler.compiler_for_run(lambda text: pytest.fail(text)):
        assert args.disable_comfy_compiler is True
    assert args.disable_comfy_compiler is True


def test_a_forward_under_cuda_graph_capture_stands_the_run_down(monkeypatch, tmp_path):
    monkeypatch.setattr(wrappers, "capturing", lambda: True)
    dm, m, seen = _flux_noting()
    noise, refs, txts = _inputs("flux", 0, None)
    assert torch.equal(sample(dm, m.options(), noise, refs, txts), sample(dm, {}, noise, refs, txts))
    assert len(seen) == 1 and "CUDA graph capture" in seen[0]


def test_comfyuis_graph_calls_are_declared_passive_for_the_reuse_key(monkeypatch):
    """They only record and move memory, and keep per-thread state that changes every run: a reuse key that
    followed them would miss every time under ComfyUI's compiler."""
    mp = types.ModuleType("comfy.model_prefetch")
    for name in compiler.GRAPH_CALLS:
        setattr(mp, name, types.FunctionType((lambda: None).__code__, {}, name))
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.setitem(sys.modules, "comfy.model_prefetch", mp)
    with compiler.compiler_for_run(lambda text: None):
        pass
    assert all(getattr(getattr(mp, name), "_kv_offload_passive", False) for name in compiler.GRAPH_CALLS)
