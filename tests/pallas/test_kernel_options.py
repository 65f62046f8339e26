"""KernelOptions: carried by the configs jit sees, so two settings run side by side in one process;
the BOLE_* environment variables are defaults read only by `from_env` (the CLI, `LLM`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from bole_jax import KernelOptions as PublicKernelOptions
from bole_jax.llm import LLM
from bole_jax.model import ModelConfig
from bole_jax.pallas.options import KernelOptions
from bole_jax.pallas.testing import random_gdn_inputs, random_trees
from bole_jax.pallas.tree_gdn import TreeGDNConfig, tree_gdn_verify
from bole_jax.spec_decode.step import SpecConfig, spec_step


def test_defaults_validation_and_hashing():
    d = KernelOptions()
    assert PublicKernelOptions is KernelOptions
    assert (d.tree_gdn_bf16, d.mosaic, d.commit_fold, d.lazy_rows, d.gdn_decode_backend) == (
        True,
        True,
        "auto",
        "path",
        "auto",
    )
    assert d.fused_commit and not KernelOptions.from_env({"BOLE_FUSED_COMMIT": "0"}).fused_commit
    assert hash(d) == hash(KernelOptions()) and d != KernelOptions(mosaic=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.mosaic = False
    for bad, match in (
        (dict(commit_fold="fast"), "commit_fold must be one of"),
        (dict(lazy_rows="rows"), "lazy_rows must be one of"),
        (dict(gdn_decode_backend="gpu"), "gdn_decode_backend must be one of"),
        (dict(tree_gdn_bf16=1), "tree_gdn_bf16 must be a bool"),
    ):
        with pytest.raises(ValueError, match=match):
            KernelOptions(**bad)


def test_from_env_reads_the_old_variables():
    assert KernelOptions.from_env({}) == KernelOptions()
    env = {
        "BOLE_TREE_GDN_BF16": "0",
        "BOLE_TREE_GDN_MOSAIC": "0",
        "BOLE_COMMIT_FOLD": "dot",
        "BOLE_LAZY_ROWS": "gather",
        "BOLE_GDN_DECODE_BACKEND": "reference",
    }
    assert KernelOptions.from_env(env) == KernelOptions(
        tree_gdn_bf16=False,
        mosaic=False,
        commit_fold="dot",
        lazy_rows="gather",
        gdn_decode_backend="reference",
    )
    assert KernelOptions.from_env({"BOLE_TREE_GDN_BF16": "1"}).tree_gdn_bf16
    with pytest.raises(ValueError, match="BOLE_LAZY_ROWS"):
        KernelOptions.from_env({"BOLE_LAZY_ROWS": "rows"})


def test_two_settings_in_one_process_give_two_verifies():
    """Configs that differ only in tree_gdn_bf16 are different static arguments and, through the
    auto launch they select, give different verify outputs (CPU interpret mode); each setting
    is deterministic."""
    cfg = ModelConfig.tiny()
    cfg_fp32 = dataclasses.replace(cfg, kernels=KernelOptions(tree_gdn_bf16=False))
    assert cfg != cfg_fp32 and hash(cfg) != hash(cfg_fp32)
    rng = np.random.default_rng(0)
    b, n = 2, 16
    parents, num_nodes = random_trees(rng, b, n)
    x = random_gdn_inputs(rng, b, n, 1, 2, 32, 32, np.float32)
    args = [x[k] for k in ("q", "k", "v", "g", "beta", "state")]
    outs = {}
    for c in (cfg, cfg_fp32):
        launch = TreeGDNConfig.auto(b, n, 9, c.kernels)
        assert launch.bf16_qk is c.kernels.tree_gdn_bf16
        runs = [
            tree_gdn_verify(
                *args,
                parents,
                num_nodes,
                backend="pallas",
                interpret=True,
                config=launch,
                depth_bound=9,
            )
            for _ in range(2)
        ]
        (o1, f1), (o2, f2) = runs
        np.testing.assert_array_equal(o1, o2)
        np.testing.assert_array_equal(f1.u, f2.u)
        outs[c.kernels.tree_gdn_bf16] = o1
    diff = float(jnp.max(jnp.abs(outs[True] - outs[False])))
    assert diff > 1e-5, diff  # bf16 operands round q, k and the state: visibly different


def test_llm_carries_the_options(monkeypatch):
    cfg = ModelConfig.tiny()
    opts = KernelOptions(lazy_rows="gather", commit_fold="loop")
    llm = LLM(cfg, kernel_options=opts)
    assert llm.cfg.kernels == opts
    spec = llm._spec_config("bole")
    assert spec.kernels == opts
    lazy = dataclasses.replace(spec, lazy_commit=True)
    assert lazy.pending_length and lazy.pending_nodes is None  # gathered rows: no factors kept
    assert dataclasses.replace(lazy, kernels=KernelOptions()).pending_nodes == (
        spec.shape.num_nodes
    )
    # no options: the environment's, as defaults
    monkeypatch.setenv("BOLE_COMMIT_FOLD", "dot")
    assert LLM(cfg).cfg.kernels == KernelOptions(commit_fold="dot")
    monkeypatch.delenv("BOLE_COMMIT_FOLD")
    assert LLM(cfg).cfg.kernels == KernelOptions()


def test_spec_step_refuses_options_that_differ():
    cfg = ModelConfig.tiny()
    spec = SpecConfig(kernels=KernelOptions(mosaic=False))
    with pytest.raises(ValueError, match="build both from one KernelOptions"):
        spec_step(None, None, cfg=cfg, spec=spec)


def _verify_errors(launches: dict, seed: int, state_scale: float = 1.0) -> dict:
    """max |o - o_ref| of the interpret-mode Pallas verify against the sequential recurrence,
    per launch: {name: tree_gdn_verify keywords (config= or options=)}, all on the same random
    trees (B = 2, N = 16) and inputs, the committed state scaled by state_scale."""
    from bole_jax.pallas.tree_gdn_ref import tree_gdn_sequential

    rng = np.random.default_rng(seed)
    parents, num_nodes = random_trees(rng, 2, 16)
    x = random_gdn_inputs(rng, 2, 16, 1, 2, 32, 32, np.float32)
    x["state"] = x["state"] * state_scale
    args = [x[k] for k in ("q", "k", "v", "g", "beta", "state")]
    o_ref, _ = tree_gdn_sequential(*args, parents, num_nodes)
    err = {}
    for name, kw in launches.items():
        o, _ = tree_gdn_verify(
            *args, parents, num_nodes, backend="pallas", interpret=True, depth_bound=9, **kw
        )
        err[name] = float(jnp.max(jnp.abs(o - o_ref)))
    return err


def test_state_numerics_select_the_launch_and_bring_the_verify_to_the_recurrence():
    """tree_gdn_state picks the state dots' operands (bf16 / fp32 on TF32 / ~fp32 in three
    passes) of the auto launch and keeps the Mosaic verify to bf16; in interpret mode (fp32
    dots) fp32 state operands bring the outputs and factors closer to the sequential
    recurrence the one-token decode runs than bf16 ones do."""
    from bole_jax.pallas import tree_gdn as tg

    assert KernelOptions.from_env({"BOLE_TREE_GDN_STATE": "fp32"}).tree_gdn_state == "fp32"
    with pytest.raises(ValueError, match="BOLE_TREE_GDN_STATE"):
        KernelOptions.from_env({"BOLE_TREE_GDN_STATE": "fp16"})
    for state, bf16_state, precision in (
        ("bf16", True, None),
        ("tf32", False, None),
        ("fp32", False, "tf32x3"),
    ):
        launch = TreeGDNConfig.auto(16, 64, 9, KernelOptions(tree_gdn_state=state))
        assert (launch.bf16_qk, launch.bf16_state, launch.precision) == (
            True,
            bf16_state,
            precision,
        )
    if tg.tree_gdn_mgpu.AVAILABLE:  # the GPU image: the Mosaic route only with bf16 state dots
        assert tg.mosaic_launch(16, 64, 128, 128, jnp.bfloat16, 9, KernelOptions()) is not None
    assert (
        tg.mosaic_launch(16, 64, 128, 128, jnp.bfloat16, 9, KernelOptions(tree_gdn_state="tf32"))
        is None
    )

    # a committed state that dominates the outputs; the fp32 interpret launch of each option
    err = _verify_errors(
        {
            (bf16, state): dict(
                config=TreeGDNConfig.auto(
                    2, 16, 9, KernelOptions(tree_gdn_bf16=bf16, tree_gdn_state=state)
                )
            )
            for bf16, state in ((True, "bf16"), (True, "fp32"), (False, "fp32"))
        },
        seed=1,
        state_scale=4.0,
    )
    # the normalized q and k rounded to bf16 (tree_gdn_bf16) are most of the error left
    assert err[False, "fp32"] < 1e-6 < err[True, "fp32"] < err[True, "bf16"], err


def test_node_numerics_select_the_launch_and_bring_the_verify_to_the_recurrence():
    """tree_gdn_nodes="fp32" takes the node-by-node dots (K K^T, Q K^T, the inverse, T rhs,
    the outputs' (Q K^T * Gam) U) on fp32 operands in three TF32 passes and leaves the state
    dots to tree_gdn_state; no Mosaic verify. With the device's roundings emulated it brings
    the outputs closer to the sequential recurrence than the default launch, and with fp32
    state dots too as close as the all-fp32 launch."""
    from bole_jax.pallas import tree_gdn as tg

    assert KernelOptions().tree_gdn_nodes == "bf16"
    assert KernelOptions.from_env({"BOLE_TREE_GDN_NODES": "fp32"}).tree_gdn_nodes == "fp32"
    with pytest.raises(ValueError, match="BOLE_TREE_GDN_NODES"):
        KernelOptions.from_env({"BOLE_TREE_GDN_NODES": "tf32"})
    for nodes, bf16_qk, precise in (("bf16", True, False), ("fp32", False, True)):
        launch = TreeGDNConfig.auto(16, 32, 9, KernelOptions(tree_gdn_nodes=nodes))
        assert (launch.bf16_qk, launch.bf16_state, launch.precision, launch.precise_nodes) == (
            bf16_qk,
            True,
            None,
            precise,
        )
    assert (
        tg.mosaic_launch(16, 64, 128, 128, jnp.bfloat16, 9, KernelOptions(tree_gdn_nodes="fp32"))
        is None
    )

    err = _verify_errors(
        {
            (nodes, bf16, state): dict(
                options=KernelOptions(
                    tree_gdn_bf16=bf16,
                    tree_gdn_state=state,
                    tree_gdn_nodes=nodes,
                    interpret_numerics="device",
                )
            )
            for nodes, bf16, state in (
                ("bf16", True, "bf16"),
                ("fp32", True, "bf16"),
                ("fp32", True, "fp32"),
                ("bf16", False, "fp32"),
            )
        },
        seed=3,
    )
    assert err["fp32", True, "bf16"] < err["bf16", True, "bf16"], err
    assert err["fp32", True, "fp32"] < err["fp32", True, "bf16"], err
    assert err["fp32", True, "fp32"] < 2 * err["bf16", False, "fp32"] + 1e-7, err


def test_interpret_numerics_device_emulates_the_launch_roundings():
    """interpret_numerics="device": interpret mode takes the table's launch with its bf16
    operands and TF32 dots emulated, so a CPU run reproduces the device's rounding: further from
    the sequential recurrence than the fp32 interpret default, and more so with bf16 state
    operands than with fp32 ones (TF32-rounded); "fp32" is the default and keeps the fp32
    launch."""
    from bole_jax.pallas.triton_ops import TF32_EMULATED, dot, to_tf32

    assert KernelOptions().interpret_numerics == "fp32"
    assert KernelOptions.from_env({"BOLE_INTERPRET_NUMERICS": "device"}).interpret_numerics == (
        "device"
    )
    with pytest.raises(ValueError, match="BOLE_INTERPRET_NUMERICS"):
        KernelOptions.from_env({"BOLE_INTERPRET_NUMERICS": "tf32"})
    x = jnp.asarray([1.0 + 2.0**-12, 1.0 + 2.0**-9], jnp.float32)
    np.testing.assert_array_equal(to_tf32(x), [1.0, 1.0 + 2.0**-9])  # 10 mantissa bits kept
    a = jnp.full((1, 1), 1.0 + 2.0**-12, jnp.float32)
    assert float(dot(a, a, TF32_EMULATED)[0, 0]) == 1.0
    assert float(dot(a, a)[0, 0]) > 1.0
    with pytest.raises(ValueError, match="precision"):
        dot(a, a, "tf16")

    err = _verify_errors(
        {
            (numerics, bf16, state): dict(
                options=KernelOptions(
                    tree_gdn_bf16=bf16, tree_gdn_state=state, interpret_numerics=numerics
                )
            )
            for numerics, bf16, state in (
                ("fp32", True, "bf16"),
                ("device", False, "tf32"),
                ("device", True, "tf32"),
                ("device", True, "bf16"),
            )
        },
        seed=2,
        state_scale=4.0,
    )
    assert err["fp32", True, "bf16"] < 1e-5, err  # the default: fp32 whatever the options say
    assert 1e-5 < err["device", False, "tf32"] < err["device", True, "tf32"], err
    assert err["device", True, "tf32"] < err["device", True, "bf16"], err
