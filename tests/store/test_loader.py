import pytest
import torch

from sgl_pic.rope import apply_rope, default_inv_freq, rerotate
from sgl_pic.store.disk.store import DiskStore, DiskStoreConfig
from sgl_pic.store.host import HostStore, HostStoreConfig
from sgl_pic.store.loader import ChunkPlacement, LoaderConfig, SparseLoader, complement
from tests.store.helpers import MODEL, make_record

HEAD_DIM = 64
INV_FREQ = default_inv_freq(HEAD_DIM, 10000.0)


class RecordingHost(HostStore):
    """A host store that remembers every sparse request it served."""

    def __init__(self) -> None:
        super().__init__(HostStoreConfig(capacity_bytes=1 << 26), MODEL)
        self.requests: list[tuple[str, range, list[int]]] = []

    def get_layers(self, key, layers, token_indices=None, token_ids=None):
        part = super().get_layers(key, layers, token_indices, token_ids)
        if part is not None:
            self.requests.append((key, layers, part.token_indices.tolist()))
        return part


def make_store(kind, tmp_path):
    if kind == "host":
        return HostStore(HostStoreConfig(capacity_bytes=1 << 26), MODEL)
    return DiskStore(DiskStoreConfig(root=str(tmp_path), capacity_bytes=1 << 26), MODEL)


def test_complement():
    assert complement([0, 3, 3], 5).tolist() == [1, 2, 4]
    assert complement([], 3).tolist() == [0, 1, 2]
    assert complement(range(4), 4).numel() == 0


def test_moves_exactly_the_complement_layer_by_layer():
    store = RecordingHost()
    a = make_record(seed=1, num_layers=4, num_tokens=40, head_dim=HEAD_DIM)
    b = make_record(seed=2, num_layers=4, num_tokens=25, head_dim=HEAD_DIM)
    store.put(a)
    store.put(b)
    rec_a, rec_b = [0, 5, 6, 39], list(range(0, 25, 5))
    chunks = [
        ChunkPlacement(a.key, 40, offset=10, recompute=torch.tensor(rec_a)),
        ChunkPlacement(b.key, 25, offset=60, recompute=torch.tensor(rec_b), token_ids=b.token_ids),
    ]
    loader = SparseLoader(store, INV_FREQ, LoaderConfig())
    total = 0
    for layer in range(4):
        out = loader.load_layer(chunks, layer)
        want_a = [i for i in range(40) if i not in rec_a]
        want_b = [i for i in range(25) if i not in rec_b]
        assert store.requests[-2:] == [
            (a.key, range(layer, layer + 1), want_a),
            (b.key, range(layer, layer + 1), want_b),
        ]
        assert out.positions.tolist() == [10 + i for i in want_a] + [60 + i for i in want_b]
        n = len(want_a) + len(want_b)
        assert out.k.shape == (n, 3, HEAD_DIM)
        assert out.bytes_moved == 2 * n * a.row_bytes
        assert torch.equal(out.v, torch.cat([a.v[layer, want_a], b.v[layer, want_b]]))
        total += out.bytes_moved
    s = loader.stats()
    assert s.bytes_moved == total == store.stats().bytes_read
    assert s.bytes_dense == 4 * 2 * (40 + 25) * a.row_bytes
    assert s.tokens_moved == 4 * (36 + 20) and s.misses == 0
    # The stored record was never rotated or written into.
    assert torch.equal(store.get(a.key).k, a.k)


@pytest.mark.parametrize("kind", ["host", "disk"])
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_deferred_rope_equals_post_rope_reuse(tmp_path, kind, layout):
    store = make_store(kind, tmp_path)
    rec = make_record(seed=3, num_layers=2, num_tokens=48, head_dim=HEAD_DIM)
    store.put(rec)
    offset, old_offset = 3000, 17
    recompute = torch.tensor([1, 2, 30])
    loader = SparseLoader(store, INV_FREQ, LoaderConfig(rope_layout=layout))
    chunk = ChunkPlacement(rec.key, 48, offset, recompute)
    reuse = chunk.reuse
    for layer in range(2):
        got = loader.load_layer([chunk], layer)
        pre = rec.k[layer, reuse]
        target = apply_rope(pre, offset + reuse, INV_FREQ, layout)
        assert (got.k - target).abs().max() < 1e-5
        # Keys cached post-RoPE at another position, then moved: the same keys.
        cached_post = apply_rope(pre, old_offset + reuse, INV_FREQ, layout)
        moved = rerotate(cached_post, old_offset + reuse, offset + reuse, INV_FREQ, layout)
        assert (got.k - moved).abs().max() < 1e-5
        # And the rotation really happened (pre-RoPE keys differ from rotated ones).
        assert (got.k - pre).abs().max() > 1e-2


def test_scatter_writes_only_reused_positions():
    store = RecordingHost()
    rec = make_record(seed=4, num_layers=1, num_tokens=10, head_dim=HEAD_DIM)
    store.put(rec)
    chunk = ChunkPlacement(rec.key, 10, offset=5, recompute=torch.tensor([0, 9]))
    loader = SparseLoader(store, INV_FREQ, LoaderConfig())
    loaded = loader.load_layer([chunk], 0)
    k_buf = torch.full((20, 3, HEAD_DIM), float("nan"))
    v_buf = torch.full((20, 3, HEAD_DIM), float("nan"))
    SparseLoader.scatter(loaded, k_buf, v_buf)
    filled = (~k_buf.isnan().all(-1).all(-1)).nonzero().flatten().tolist()
    assert filled == list(range(6, 14))  # offset 5 + local 1..8
    assert torch.equal(v_buf[6:14], rec.v[0, 1:9])


def test_missing_chunk_is_reported(tmp_path):
    store = make_store("host", tmp_path)
    present = make_record(seed=5, num_layers=1, head_dim=HEAD_DIM)
    store.put(present)
    absent = make_record(seed=6, num_layers=1, head_dim=HEAD_DIM)
    chunks = [
        ChunkPlacement(absent.key, 40, 0, torch.tensor([0])),
        ChunkPlacement(present.key, 40, 40, torch.tensor([0])),
    ]
    out = SparseLoader(store, INV_FREQ, LoaderConfig()).load_layer(chunks, 0)
    assert out.missing == (absent.key,)
    assert out.positions.tolist() == list(range(41, 80))


def test_fully_recomputed_chunk_moves_nothing():
    store = RecordingHost()
    rec = make_record(seed=7, num_layers=1, num_tokens=6, head_dim=HEAD_DIM)
    store.put(rec)
    chunk = ChunkPlacement(rec.key, 6, 0, torch.arange(6))
    out = SparseLoader(store, INV_FREQ, LoaderConfig()).load_layer([chunk], 0)
    assert out.positions.numel() == 0 and out.bytes_moved == 0 and store.requests == []


def test_config_validation():
    with pytest.raises(ValueError, match="valid"):
        LoaderConfig(rope_layout="gptj")
    with pytest.raises(ValueError):
        ChunkPlacement("0" * 64, 0, 0, torch.tensor([]))
