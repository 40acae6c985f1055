"""One wire, whatever the device (compression/collective.py): everything between sites is staged to host memory in
the collective's public methods, and the transfers underneath refuse anything else.

No GPU here: tests/off_host.py's ``OffHost`` tensors say they live off the host (their values are on it), so the
exchange takes the path a GPU run takes. Before the staging, the first tagged message of such a run raised in the
tag's ``.numpy()`` (as a CUDA tensor does) and the peers saw a transport failure.
"""
import pytest
import torch

from megatron_dilocox.compression.auth import derive_key
from megatron_dilocox.compression.collective import Collective, OffHostTensor, to_device, to_host
from tests import off_host
from tests.off_host import OffHost
from tests.workers import assert_no_errors, dilocox_spec, train_clusters


class MirrorPair(Collective):
    """Two members in one process: member 1 sends back what member 0 sends, and both are cluster 0 (so every tag
    member 0 made verifies as member 1's); the wire records the device of every tensor it is handed."""

    def __init__(self):
        super().__init__()
        self.rank, self.size, self.key = 0, 2, derive_key("s", "session")
        self.wire: list[str] = []

    def cluster_of(self, rank):
        return 0

    def _see(self, *tensors):
        self.wire += [str(t.device) for t in tensors]

    def _all_gather(self, buf):
        self._see(buf)
        return [buf, buf.clone()]

    def _all_to_all(self, pieces, sizes_in):
        self._see(*pieces)
        return [p.clone() for p in pieces]

    def _broadcast(self, buf, src, timeout=None):
        self._see(buf)
        return buf.clone()

    def _all_reduce_sum(self, buf, timeout=None):
        self._see(buf)
        return buf * 2


@pytest.mark.unit
def test_staging_copies_an_off_host_tensor_out_and_back_and_leaves_a_host_tensor_alone():
    host = torch.randn(5, 3)
    assert to_host(host) is host and to_device(host, torch.device("cpu")) is host  # no copy on a CPU run
    with off_host.mode():
        dev = host.to("meta")
        assert isinstance(dev, OffHost) and dev.device.type == "meta"
        staged = to_host(dev)
        assert type(staged) is torch.Tensor and staged.device.type == "cpu" and torch.equal(staged, host)
        back = to_device(staged, dev.device)
        assert isinstance(back, OffHost) and torch.equal(back.cpu(), host)


@pytest.mark.unit
def test_every_collective_takes_device_tensors_and_the_wire_sees_only_host_ones():
    """all_gather, all_to_all, broadcast (sealed) and all_reduce_sum given off-host tensors: the same values as
    given host tensors, returned on the device they came from; the wire was handed host tensors only."""
    x, pieces = torch.randn(7), [torch.arange(5, dtype=torch.uint8), torch.arange(3, dtype=torch.uint8)]
    ref = MirrorPair()
    want = (ref.all_gather(x, (1, 0, "t")), ref.all_to_all(pieces, [5, 3], (1, 0, "a2a")),
            ref.broadcast(x, 0, (1, 0, "b")), ref.all_reduce_sum(x))
    pair = MirrorPair()
    with off_host.mode():
        got = (pair.all_gather(x.to("meta"), (1, 0, "t")),
               pair.all_to_all([p.to("meta") for p in pieces], [5, 3], (1, 0, "a2a")),
               pair.broadcast(x.to("meta"), 0, (1, 0, "b")), pair.all_reduce_sum(x.to("meta")))
        flat = [*got[0], *got[1], got[2], got[3]]
        assert all(t.device.type == "meta" for t in flat)
        flat = [t.cpu() for t in flat]
    assert all(torch.equal(a, b) for a, b in zip(flat, [*want[0], *want[1], want[2], want[3]]))
    assert pair.wire and set(pair.wire) == {"cpu"}


@pytest.mark.unit
def test_the_wire_refuses_a_tensor_off_the_host_naming_it():
    """The boundary itself: a transfer handed a device tensor (a path that skipped the staging) raises
    OffHostTensor, a TypeError: the exchange re-raises it in the main thread instead of taking it for a lost peer
    (outer/membership_round.py)."""
    pair = MirrorPair()
    with off_host.mode(), pytest.raises(OffHostTensor, match="tensor on meta reached the inter-cluster wire"):
        pair._timed(pair._all_to_all, [torch.zeros(3, dtype=torch.uint8).to("meta")], [3])
    assert issubclass(OffHostTensor, TypeError) and pair.wire == []


SETTINGS = {  # three sites, so the default scheme is the reduce-scatter; every payload tagged
    "defaults": {},  # low rank, int4
    "int4-whole-outer-state-on-device": dict(lowrank=False, outer_state_device="param"),
    "fp32-two-fragments": dict(quant_bits=32, lowrank=False, fragments=2, overlap="one-step-delay"),
    "sparse": dict(sparse_k=8, sparse_chunk=128, link_budget=False),  # every round sparse (all-gathered)
}


@pytest.mark.core
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_run_on_device_parameters_is_bitwise_the_run_on_host_ones(name):
    """Three real clusters (gloo, authenticated), the parameters and batches off the host (and the outer state too,
    with ``outer_state_device param``): every round's global-model hash equals the same run's on host tensors,
    bitwise, on every cluster."""
    hashes = {}
    for where in ("host", "device"):
        res = train_clusters(3, steps=6, off_host=(where == "device"),
                             dilocox=dilocox_spec(3, h=2, **SETTINGS[name]))
        assert_no_errors(res)
        want = {"cpu", "meta"} if where == "device" else {"cpu"}
        if where == "device" and SETTINGS[name].get("outer_state_device") == "param":
            want = {"meta"}
        assert all(set(r["devices"]) == want for r in res.values()), [r["devices"] for r in res.values()]
        hashes[where] = [[r["global_model_hash"] for r in res[(c, 0)]["rows"]] for c in range(3)]
        assert len(hashes[where][0]) >= 3 and all(h == hashes[where][0] for h in hashes[where])
    assert hashes["device"] == hashes["host"]
