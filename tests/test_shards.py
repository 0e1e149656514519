"""ShardWriter: a streamed shard is a valid safetensors file that the library reads back bit for
bit, and its recorded sha256 and size are the file's, also when large chunks are hashed on the
second thread while being written and the kernel's writeback is started along the way."""

import hashlib
import itertools

import torch
from safetensors import safe_open

from quantize.names import PARTIAL
from quantize.plan import OutTensor
from quantize.source.checkpoint import st_dtype
from quantize.write import shards
from quantize.write.shards import ShardWriter


def test_streamed_shard_reads_back_exactly(tmp_path, monkeypatch):
    kicks = []
    real = shards.start_writeback

    def counted(fd, offset, nbytes):
        kicks.append((offset, nbytes))
        real(fd, offset, nbytes)

    monkeypatch.setattr(shards, "WRITEBACK_BYTES", 2**20)  # every MiB: several times below
    monkeypatch.setattr(shards, "start_writeback", counted)
    g = torch.Generator().manual_seed(3)
    tensors = {  # >= 1 MiB tensors take the hashing thread, the small ones hash inline
        "a.weight_packed": torch.randint(-2**31, 2**31 - 1, (512, 1024), dtype=torch.int32, generator=g),
        "a.weight_scale": torch.randn(512, 256, generator=g).to(torch.bfloat16),
        "a.weight_shape": torch.tensor([512, 8192]),
        "b.weight": torch.randn(1024, 768, generator=g).to(torch.bfloat16),
    }
    planned = [OutTensor(n, st_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "model-00001-of-00001.safetensors"
    with ShardWriter(path, planned) as w:
        for t in tensors.values():
            w.write(t)
    data = path.read_bytes()
    assert w.sha256 == hashlib.sha256(data).hexdigest()
    assert w.nbytes == len(data)
    assert not (tmp_path / (path.name + PARTIAL)).exists()
    # writeback ranges are consecutive and cover what was written before each kick
    assert len(kicks) >= 2
    assert kicks[0][0] == 0 and all(b[0] == a[0] + a[1] for a, b in itertools.pairwise(kicks))
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for n, t in tensors.items():
            assert torch.equal(f.get_tensor(n), t), n
