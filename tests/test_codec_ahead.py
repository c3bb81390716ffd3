"""Codec kernels built ahead of time (NOTE [ Codec kernels built ahead ] in
ds_hilore/runtime/codec_ahead.py): built once into a folder, loaded by ``Codec.warmup`` with
nothing compiled at run time, bitwise the eager codec's payloads, scales and decoded values (the
error sums in their last bits only, as the run-time compiled kernels); a package that does not
load, fails when run, or is not there leaves the run-time compiler in charge, said.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from ds_hilore.runtime import codec_ahead, codecs
from ds_hilore.runtime.codecs import CODECS, compiled_graph_counts, get_codec

COMPILE_UNAVAILABLE = codecs.compile_unavailable("cpu")  # the probe the library uses
needs_compile = pytest.mark.skipif(
    COMPILE_UNAVAILABLE is not None, reason=f"codec_backend 'compile' unavailable: {COMPILE_UNAVAILABLE}")
INT8 = CODECS["int8"].kernels()


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A cache folder of the test's own; every kernel forgets what it loaded afterwards, so no
    later test runs a package this one built."""
    monkeypatch.setenv("DS_HILORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(codec_ahead, "_hinted", False)
    _forget()
    yield tmp_path
    _forget()


def _forget() -> None:
    """Every kernel forgets the folder's packages: those it loaded, those it looked for."""
    codec_ahead.cache_folder.cache_clear()
    for spec in CODECS.values():
        for kernel in spec.kernels():
            kernel.ahead.clear()
            kernel._looked.clear()


def _inputs():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(2, 2, generator=g)
    yield torch.randn(37, 5, generator=g) * 1e-3
    x = torch.randn(300, 256, generator=g) * 4
    x[3, :7] = -math.inf  # carried as the int8 sentinel (NOTE [ -inf in int8 ])
    x[5] = 0.0  # an all-zero row: scale 1
    yield x
    yield torch.randn(9, 5000, generator=g)  # a row longer than 4096 elements


@pytest.mark.slow
@needs_compile
def test_kernels_built_ahead_load_without_compiling_and_match_eager_bitwise(folder, monkeypatch):
    paths = codecs.build_ahead(["int8"], [torch.float32], say=lambda line: None)
    assert {p.name for p in paths} == {"_int8_encode-float32", "_int8_encode_fast-float32",
                                       "_int8_rescale-float32"}
    assert all(p.parent == codec_ahead.cache_folder() and p.parent.parent.parent == folder
               and p.is_dir() for p in paths)  # unpacked: read in place
    assert sorted(codec_ahead.cache_folder().iterdir()) == sorted(paths)  # nothing left aside
    before = compiled_graph_counts()
    ahead, eager = get_codec("int8", backend="compile"), get_codec("int8", backend="eager")
    scratch = folder / "scratch"  # where the loader would unpack a package file
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    ahead.warmup((torch.float32,), "cpu")
    assert all(k.ahead for k in INT8 if codec_ahead.signature(k.name))
    assert list(scratch.iterdir()) == []  # nothing a killed rank would leave behind
    for x in _inputs():
        for measure in (True, False):
            got, want = ahead.pack(x, measure), eager.pack(x, measure)
            assert torch.equal(got.payload, want.payload) and torch.equal(got.scales, want.scales)
            if measure:
                assert got.rel_error == pytest.approx(want.rel_error, rel=1e-6, abs=1e-12)
            else:
                assert got.rel_error is None and got.stats[0] == want.stats[0]
                assert got.stats[1].item() == pytest.approx(want.stats[1].item(), rel=1e-12)
            out = torch.full(x.shape, 7.0)  # written in place by the built rescale
            assert ahead.unpack(got, out) is out and torch.equal(out, eager.unpack(want))
            buffer = torch.full((x.numel() + 11,), 7.0)  # a slice at an offset, as storage.py
            inside = buffer[5:5 + x.numel()].view(x.shape)
            ahead.unpack(got, inside)
            assert torch.equal(inside, out) and (buffer[:5] == 7).all() and (buffer[-6:] == 7).all()
    nan = torch.ones(4, 8)
    nan[1, 2] = math.nan
    assert ahead.pack(nan) is None  # not finite: the unit stays H, as with every backend
    assert compiled_graph_counts() == before  # nothing was compiled at run time
    # a second build finds them there and builds nothing
    said = []
    assert codecs.build_ahead(["int8"], [torch.float32], say=said.append) == paths and said == []
    # a dtype the warm-up did not load (a bf16 model's fp32 norms) is loaded at its first call
    _forget()
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ahead.pack(x, False).payload, eager.pack(x, False).payload)
    assert (torch.float32,) in next(k for k in INT8 if k.name == "_int8_encode_fast").ahead
    assert compiled_graph_counts() == before  # loaded, not compiled


def test_a_package_that_does_not_load_is_said_and_compiled_at_run_time(folder, caplog):
    path = codec_ahead.cache_folder() / "_int8_encode-float32"
    path.mkdir(parents=True)
    (path / "archive_format").write_bytes(b"not a package")
    with caplog.at_level(logging.WARNING, logger="ds_hilore"):
        assert codec_ahead.load("_int8_encode", torch.float32) is None
    assert "does not load" in caplog.text and "compiled at run time" in caplog.text
    codec_ahead.load_into(INT8, (torch.float32,))
    assert not any(k.ahead for k in INT8)


def test_a_built_kernel_that_fails_is_dropped_and_said(monkeypatch, caplog):
    kernel = codecs._Kernel(codecs._int8_encode, unbacked=True)  # a fresh one: nothing shared

    def fails(args):
        raise RuntimeError("a package that loaded but does not run")

    kernel.ahead[(torch.float32,)] = fails
    monkeypatch.setattr(codecs, "compile_unavailable", lambda device: "no compiler (test)")
    monkeypatch.setattr(codec_ahead, "load_key", lambda kernel, key, dtypes: kernel.ahead.update(
        {key: fails}))  # the same package, where it would be looked for again
    with caplog.at_level(logging.WARNING, logger="ds_hilore"):
        assert kernel.compiled(torch.ones(4, 8)) is codecs._FAILED  # then the eager kernel
        assert kernel.compiled(torch.ones(4, 8)) is codecs._FAILED  # not loaded, run, said again
    assert kernel.ahead == {} and caplog.text.count("built ahead failed") == 1


def test_without_a_compiler_nothing_is_built_and_that_is_said(folder):
    said = []
    assert codec_ahead.build_all(INT8, [torch.float32], say=said.append,
                                 unavailable="inductor finds no C++ compiler (test)") == []
    assert said == ["codec kernels not built ahead: inductor finds no C++ compiler (test)"]
    assert not codec_ahead.cache_folder().exists()


def test_without_packages_the_run_says_once_how_to_build_them(folder, caplog):
    with caplog.at_level(logging.INFO, logger="ds_hilore"):
        codec_ahead.load_into(INT8, (torch.float32,))
        codec_ahead.load_into(INT8, (torch.bfloat16,))
    lines = [r.getMessage() for r in caplog.records if "built ahead" in r.getMessage()]
    assert len(lines) == 1 and "hilore env --build-codecs" in lines[0]
    assert "_int8_encode (float32)" in lines[0] and str(codec_ahead.cache_folder()) in lines[0]
    assert not any(k.ahead for k in INT8)


def test_the_folder_names_what_the_code_depends_on(folder, monkeypatch):
    here = codec_ahead.cache_folder()
    assert torch.__version__.replace("+", "_") in here.name
    assert torch.backends.cpu.get_cpu_capability() in here.name
    # another CPU model of the same capability (a home folder shared between machines)
    monkeypatch.setattr(codec_ahead, "_cpu_model", lambda: "model name : another CPU")
    codec_ahead.cache_folder.cache_clear()
    elsewhere = codec_ahead.cache_folder()
    assert elsewhere.parent == here.parent and elsewhere != here
    assert not codec_ahead.signature("_fp8_encode_ragged")  # takes a block size: run time only


@pytest.mark.slow
@needs_compile
def test_a_package_that_does_not_load_is_built_again(folder):
    """A folder there that does not load (a disk error, one damaged by hand) is replaced by the
    next build, not kept for good."""
    path = codec_ahead._path("_int8_rescale", torch.float32)
    path.mkdir(parents=True)
    (path / "archive_format").write_bytes(b"not a package")
    kernel = next(k for k in INT8 if k.name == "_int8_rescale")
    assert codec_ahead.build(kernel.name, kernel.fn, torch.float32) == path
    assert codec_ahead.load(kernel.name, torch.float32) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_codec_is_warmed_for_the_activations_dtype_and_fp32(dtype, monkeypatch):
    """NOTE [ A codec's first use ] (plan/metering.py): a bf16 model's norms save fp32 tensors,
    packed too, so its warm-up covers fp32 besides bf16 (before, fp32's kernels compiled at
    their first pack, inside a profiled microbatch)."""
    from models import VOCAB, tiny_model

    import ds_hilore

    warmed = []
    monkeypatch.setattr(codecs.Codec, "warmup",
                        lambda self, dtypes=(torch.float32,), device="cpu": warmed.append(dtypes))
    model = tiny_model("qwen2", layers=2, hidden=64, heads=4, intermediate=128, dropout=False)
    runtime = ds_hilore.attach(model.to(dtype), {"low_precision": "int8"})
    try:
        ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, use_cache=False).logits.float().mean().backward()
        assert warmed == [(dtype,) if dtype == torch.float32 else (dtype, torch.float32)]
    finally:
        runtime.detach()


def test_two_builds_over_a_package_that_does_not_load_both_end_with_it_there(folder, monkeypatch):
    """Two ranks build over a folder that does not load: one removes it, the other's lands
    before the first moves its own (simulated in that order; no compiler needed). The first
    finds a package that loads there and says nothing went wrong."""
    import shutil
    import zipfile

    def package(program, package_path, inductor_configs):
        with zipfile.ZipFile(package_path, "w") as archive:
            archive.writestr("built", "1")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", package)
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: None)
    monkeypatch.setattr(codec_ahead, "_loader",
                        lambda path: (lambda args: args) if (path / "built").is_file() else None)
    path = codec_ahead._path("_int8_rescale", torch.float32)
    path.mkdir(parents=True)
    (path / "archive_format").write_text("not a package")
    remove = shutil.rmtree

    def the_other_lands(target, ignore_errors=False):
        remove(target, ignore_errors=ignore_errors)
        if target == path:
            path.mkdir()
            (path / "built").write_text("the other rank's")

    monkeypatch.setattr(codec_ahead.shutil, "rmtree", the_other_lands)
    said = []
    kernel = next(k for k in INT8 if k.name == "_int8_rescale")
    assert codec_ahead.build_all([kernel], [torch.float32], say=said.append) == [path]
    assert said == [] and (path / "built").read_text() == "the other rank's"
