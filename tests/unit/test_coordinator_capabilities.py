"""Device capabilities (issue 13): the agent's hello says whether MXNet loads and which
trainers and native kernels it has; the coordinator records them and does not send a job
that needs MXNet (a head deeper than one dense layer, or trainer=mxnet) to a device
without it -- a 32-bit Raspberry Pi. An older agent that says nothing is not excluded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator.artefacts import ModelArtefacts
from edge_agent.coordinator.selection import (
    capabilities_from_hello,
    head_needs_mxnet,
    job_needs,
    select_devices,
)
from edge_agent.int8.bundle_create import create_bundle
from edge_agent.int8.bundle_files import pack_bundle
from edge_agent.protocol.schema import Kind, check_body
from edge_agent.sim import models
from tests.unit.test_coordinator_rounds import T0, Clock, Harness, dev, softmax_head
from tests.unit.test_coordinator_rounds import fleet as fleet  # the module-scoped fixture


def deep_head() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"dense0_weight": rng.normal(size=(32, 64)).astype(np.float32), "dense0_bias": np.zeros(32, np.float32),
            "dense1_weight": rng.normal(size=(10, 32)).astype(np.float32), "dense1_bias": np.zeros(10, np.float32)}


def test_which_jobs_need_mxnet() -> None:
    assert not head_needs_mxnet(softmax_head()) and head_needs_mxnet(deep_head())
    assert head_needs_mxnet({"w": np.zeros((4, 4)), "gamma": np.ones(4), "beta": np.zeros(4)})  # BatchNorm
    assert job_needs({}, None) == frozenset()  # nothing known: nobody excluded
    assert job_needs({"trainer": "mxnet"}, (True,)) == {"mxnet"}
    assert job_needs({}, (False,)) == {"mxnet"}  # a head only MXNet trains
    # the job's depth decides (issue 35 #25): numpy trains depths 0 and 1 of this model, not 2
    model = (True, True, False)
    assert job_needs({"depth": "head"}, model) == job_needs({"depth": 1}, model) == frozenset()
    assert job_needs({"depth": 2}, model) == {"mxnet"}
    assert job_needs({}, model) == job_needs({"depth": "auto"}, model) == frozenset()  # auto: judged at depth 0
    assert job_needs({"depth": "auto"}, (False, True)) == {"mxnet"}
    assert job_needs({"depth": 5}, model) == frozenset()  # no such depth: the devices refuse it, saying so
    assert job_needs({"depth": "head", "trainer": "numpy"}, model) == frozenset()
    assert job_needs({"depth": "head", "trainer": "mxnet"}, model) == {"mxnet"}


@pytest.fixture(scope="module")
def multi_depth_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits CNN as a 3-depth bundle (0: dense head, 1: conv3 + BN + head, 2: conv2 +
    conv3 + head): its registered head holds every depth's tensors."""
    net = models.initialize(models.digits_cnn(), seed=0, randomize_bn=True)
    calib = np.random.default_rng(0).uniform(0, 1, (32, 1, 8, 8)).astype(np.float32)
    root = tmp_path_factory.mktemp("needs")
    bundle = create_bundle(net, root / "deep", depths=2, calibration=calib, labels=[str(i) for i in range(10)],
                           name="digits", version="1", input_shape=(1, 8, 8))
    return pack_bundle(bundle.path, root / "deep.tar.gz")


@pytest.mark.parametrize("params, all_devices", [({"depth": "head"}, True), ({"depth": 1}, True), ({}, True),
                                                 ({"depth": "head", "trainer": "mxnet"}, False)])
def test_a_32_bit_device_takes_part_at_any_depth_numpy_trains(tmp_path: Path, fleet: dict,
                                                             multi_depth_archive: Path, params: dict,
                                                             all_devices: bool) -> None:
    """Issue 35 #25: every tensor of every depth counted as the head made a multi-depth model
    'need MXNet', so 32-bit devices were left out of every job on it, even `--depth head`."""
    h = Harness(tmp_path, fleet, Clock())
    try:
        mv = ModelArtefacts(h.reg).register_bundle(multi_depth_archive)
        assert head_needs_mxnet(h.reg.load_head(mv))  # every depth's tensors: what was judged before
        for i, (did, pub) in enumerate(zip(fleet["ids"], fleet["pubs"], strict=True)):
            h.reg.enrol_device(device_id=did, public_key=pub, fleet="farm", approved=True)
            h.reg.record_state(did, online=True, state={"battery_pct": 90, "mxnet": i >= 2})  # two 32-bit devices
        h.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=1, deadline_s=60,
                           params=params)
        (plan,) = h.engine.tick().opened
        assert sorted(plan.devices) == sorted(fleet["ids"] if all_devices else fleet["ids"][2:])
    finally:
        h.reg.close()


def test_hello_capabilities_are_type_checked() -> None:
    assert capabilities_from_hello({"mxnet": False, "trainers": "numpy", "native": "armv7_neon", "name": "x",
                                    "engine_choices": True, "secagg": True}) == {
        "mxnet": False, "trainers": "numpy", "native": "armv7_neon", "engine_choices": True, "secagg": True}
    assert capabilities_from_hello({"mxnet": "no", "trainers": 3, "native": "a\nb", "engine_choices": 1,
                                    "secagg": "yes"}) == {"engine_choices": False, "secagg": False}
    # an older agent: it is sent no engine choices (they would make its strict schema refuse the
    # command) and no secure job
    assert capabilities_from_hello({}) == {"engine_choices": False, "secagg": False}


def test_a_secure_job_selects_only_devices_whose_hello_says_secagg() -> None:
    new = dev(1, state={"battery_pct": 90, "secagg": True})
    old = dev(2, state={"battery_pct": 90})  # an older agent: never said
    sel = select_devices([new, old], "all", now=T0, online_within_s=300, min_battery_pct=30,
                         needs=frozenset({"secagg"}))
    assert sel.eligible == [new.id] and "does not do secure aggregation" in sel.ineligible[old.id]
    sel = select_devices([new, old], "all", now=T0, online_within_s=300, min_battery_pct=30)
    assert sel.eligible == [new.id, old.id]  # any other job: both


def test_selection_skips_devices_without_mxnet_only_for_jobs_that_need_it() -> None:
    pi3 = dev(1, state={"battery_pct": 90, "mxnet": False, "trainers": "numpy"})
    pi4 = dev(2, state={"battery_pct": 90, "mxnet": True, "trainers": "numpy,mxnet"})
    old = dev(3)  # never said
    sel = select_devices([pi3, pi4, old], "all", now=T0, online_within_s=300, min_battery_pct=30,
                         needs=frozenset({"mxnet"}))
    assert sel.eligible == ["d2", "d3"] and "no MXNet" in sel.ineligible["d1"]
    assert select_devices([pi3, pi4, old], "all", now=T0, online_within_s=300, min_battery_pct=30).eligible == [
        "d1", "d2", "d3"]


def test_round_engine_opens_a_deep_head_round_only_on_devices_with_mxnet(tmp_path: Path, fleet: dict) -> None:
    h = Harness(tmp_path, fleet, Clock())
    try:
        h.setup(deep_head())
        for i, did in enumerate(fleet["ids"]):
            h.reg.record_state(did, online=True, state={"mxnet": i >= 2})  # two 32-bit devices
        job = h.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=1, deadline_s=60)
        (plan,) = h.engine.tick().opened
        assert sorted(plan.devices) == sorted(fleet["ids"][2:]), job
    finally:
        h.reg.close()


def test_hello_with_capabilities_validates_and_so_does_one_without() -> None:
    key = "A" * 43 + "="
    base = {"public_key": key, "agent": "edge-agent/0.1.0", "info": {"name": "pi3", "board": "Raspberry Pi 3"}}
    check_body(Kind.HELLO, base)  # an older agent
    # In `info` (a flat map any coordinator accepts), not a new top-level field that an
    # older coordinator's strict schema would refuse.
    check_body(Kind.HELLO, {**base, "info": {**base["info"], "mxnet": False, "trainers": "numpy",
                                                "native": "armv7_neon"}})


def test_this_agents_hello_carries_its_capabilities() -> None:
    from edge_agent.doctor import capabilities

    caps = capabilities()
    assert isinstance(caps["mxnet"], bool) and caps["trainers"].startswith("numpy")
    assert caps["native"] in {v.name for v in __import__("edge_agent.int8.native", fromlist=["x"]).variants()}
    # This venv's x86_64 MXNet wheel loads as shipped.
    assert caps["mxnet"] is True and caps["trainers"] == "numpy,mxnet"


def test_the_agents_hello_info_says_what_it_can_run() -> None:
    from edge_agent.agent.state import DeviceState
    from edge_agent.hardware.probe import probe

    root = Path(__file__).resolve().parents[1] / "fixtures/boards/raspberry-pi-4"
    info = DeviceState(sysfs_root=str(root), probe_report=probe(root)).hello_info("pi")
    assert {k: info[k] for k in ("mxnet", "trainers")} == {"mxnet": True, "trainers": "numpy,mxnet"}
    assert info["native"] and info["name"] == "pi"
    check_body(Kind.HELLO, {"public_key": "A" * 43 + "=", "info": info})
