"""The DataModule on small IDX files: the three data sources, the no-data error, splits and batches."""

import functools
import hashlib
import http.server
import threading

import pytest
import torch

from src.data.fashion_mnist import MEAN, RAW_FILES, STD, DataUnavailableError, FashionMNISTDataModule, ensure_raw_files
from src.data.loader import GlobalBatchSampler
from src.batch_shares import shard_sizes
from tests.helpers.idx import write_fashion_mnist


def test_files_already_present_are_used(tiny_data_dir, tmp_path):
    assert ensure_raw_files(tiny_data_dir, debian_dir=tmp_path / "none", download=False) == "present"


def test_filling_a_data_folder_says_where_the_data_came_from_once(tmp_path, monkeypatch, caplog):
    import logging

    from src.data import fashion_mnist

    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", write_fashion_mnist(tmp_path / "debian", gz=True))
    dm = FashionMNISTDataModule(str(tmp_path / "data"), val_size=100, download=False)
    with caplog.at_level(logging.INFO):
        dm.prepare_data()
        dm.prepare_data()  # the files are there now: nothing to say
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert lines == [f"data: Fashion-MNIST unpacked from Debian's dataset-fashion-mnist package ({tmp_path}/debian) "
                     f"into {tmp_path}/data/FashionMNIST/raw/ (1 MB)"], lines


def test_debian_gz_files_are_unpacked(tmp_path):
    debian = write_fashion_mnist(tmp_path / "debian", gz=True)
    root = tmp_path / "data"
    assert ensure_raw_files(root, debian_dir=debian, download=False) == "debian"
    raw = root / "FashionMNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(RAW_FILES)  # no temporary files left behind
    dm = FashionMNISTDataModule(str(root), val_size=100)
    dm.setup("fit")
    assert dm.splits["train"][0].shape == (500, 28, 28) and dm.splits["test"][0].shape == (200, 28, 28)


def test_a_crafted_idx_header_is_refused_before_allocation(tmp_path):
    import gzip
    import struct
    import tracemalloc

    from src.data.integrity import CorruptDataError

    debian = write_fashion_mnist(tmp_path / "debian", gz=True)
    # a small file whose header claims 2 billion images: 1.5 TB if a reader believed it
    claim = struct.pack(">BBBB", 0, 0, 0x08, 3) + struct.pack(">3i", 2_000_000_000, 28, 28) + bytes(784)
    with gzip.open(debian / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(claim)
    tracemalloc.start()
    with pytest.raises(CorruptDataError, match=r"2000000000 x 28 x 28\) needs 1,568,000,000,016"):
        ensure_raw_files(tmp_path / "data", debian_dir=debian, download=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50 * 2**20  # checked from the 16-byte header and the file size, nothing allocated for the claim


def test_torchvision_download_from_a_loopback_mirror(tmp_path, monkeypatch):
    served = write_fashion_mnist(tmp_path / "mirror", gz=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from torchvision.datasets import FashionMNIST

    md5 = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in served.iterdir()}
    monkeypatch.setattr(FashionMNIST, "mirrors", [f"http://127.0.0.1:{server.server_port}/"])
    monkeypatch.setattr(FashionMNIST, "resources", [(f"{n}.gz", md5[f"{n}.gz"]) for n in RAW_FILES])
    try:
        assert ensure_raw_files(tmp_path / "data", debian_dir=tmp_path / "none") == "download"
    finally:
        server.shutdown()
    assert all((tmp_path / "data" / "FashionMNIST" / "raw" / n).is_file() for n in RAW_FILES)


def test_no_data_names_the_three_ways(tmp_path):
    with pytest.raises(DataUnavailableError) as err:
        ensure_raw_files(tmp_path / "empty", debian_dir=tmp_path / "none", download=False)
    msg = str(err.value)
    assert "FashionMNIST/raw" in msg and "apt-get install dataset-fashion-mnist" in msg and "download" in msg


def test_splits_are_seeded_and_disjoint(tiny_data_dir):
    a, b = (FashionMNISTDataModule(str(tiny_data_dir), val_size=100) for _ in range(2))
    a.setup("fit"), b.setup("fit")
    assert torch.equal(a.splits["val"][0], b.splits["val"][0])
    train = {t.numpy().tobytes() for t in a.splits["train"][0]}
    assert not any(v.numpy().tobytes() in train for v in a.splits["val"][0])
    assert a.splits["train"][0].dtype == torch.uint8 and len(a.splits["train"][0]) == 500


def test_batches_are_global_and_normalised(tiny_data_dir):
    dm = FashionMNISTDataModule(str(tiny_data_dir), batch_size=64, val_size=100)
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) == 8  # 500 / 64, last batch kept
    assert [len(y) for _, y in batches] == [64] * 7 + [52]
    seen = torch.cat([y for _, y in batches])
    assert len(seen) == 500
    x, y = dm.on_before_batch_transfer(batches[0], 0)
    assert x.shape == (64, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    raw = batches[0][0].float().div(255).unsqueeze(1)
    torch.testing.assert_close(x, (raw - MEAN) / STD)


def test_epochs_reshuffle_reproducibly():
    s = GlobalBatchSampler(100, 10, shuffle=True, drop_last=False, seed=3)
    e0 = torch.cat(list(s))
    s.set_epoch(1)
    e1 = torch.cat(list(s))
    s.set_epoch(0)
    assert torch.equal(torch.cat(list(s)), e0) and not torch.equal(e0, e1)
    assert sorted(e1.tolist()) == list(range(100))


def test_ranks_take_contiguous_slices_of_each_global_batch():
    whole = list(GlobalBatchSampler(103, 10, shuffle=True, drop_last=False, seed=1))
    ranks = [list(GlobalBatchSampler(103, 10, shuffle=True, drop_last=False, seed=1, rank=r, world_size=2))
             for r in range(2)]
    for b, full in enumerate(whole):
        assert torch.equal(torch.cat([ranks[0][b], ranks[1][b]]), full)


def test_shard_sizes():
    assert shard_sizes(257, [1, 1]) == [129, 128]
    assert shard_sizes(10, [1, 1, 1]) == [4, 3, 3]
    assert shard_sizes(256, [3, 1]) == [192, 64]
    assert sum(shard_sizes(1001, [0.3, 0.5, 0.2])) == 1001
    with pytest.raises(ValueError, match="positive"):
        shard_sizes(10, [1, 0])


def test_augmentation_keeps_shape_and_moves_pixels():
    from src.data.fashion_mnist import random_crop_flip

    torch.manual_seed(0)
    x = torch.rand(32, 1, 28, 28)
    out = random_crop_flip(x)
    assert out.shape == x.shape and not torch.equal(out, x)
    # with no padding the crop is the identity, so each image is itself or its mirror
    same = random_crop_flip(x, pad=0)
    assert all(torch.equal(a, b) or torch.equal(a, b.flip(-1)) for a, b in zip(same, x))


def test_bad_batch_size_is_rejected():
    with pytest.raises(ValueError, match="batch_size"):
        FashionMNISTDataModule(batch_size=0)


@pytest.mark.parametrize("setting", ["auto", True, False])
def test_data_stays_on_the_cpu_when_training_on_the_cpu(tiny_data_dir, setting):
    import lightning.pytorch as pl

    dm = FashionMNISTDataModule(str(tiny_data_dir), val_size=100, data_on_device=setting)
    dm.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    dm.setup("fit")
    assert dm._data_device() == torch.device("cpu")
    assert all(x.device.type == "cpu" for x, _ in dm.splits.values())
    x, y = next(iter(dm.train_dataloader()))
    assert x.device.type == "cpu" and len(y) == 256
