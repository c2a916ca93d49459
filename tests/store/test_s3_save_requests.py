"""What a save costs on S3: the bytes it copies and hashes, and the requests it makes.

A chunk is uploaded from the caller's buffers as they are (a stream over the header and
the tensor's memory, not a joined copy) with a CRC32 for S3 to check, not a second
SHA-256 of the bytes; small objects (manifests, records) keep SHA-256. An incremental
save that reuses its previous save's chunk reads its header and touches it (a ranged GET
and a CopyObject), without a HEAD to ask whether it exists.
"""

from collections import Counter

import torch

from ckptflow import Checkpointer
from ckptflow.store import s3_body
from ckptflow.store.s3_body import BuffersReader

CHUNK = 1 << 20  # bytes: one chunk per MiB, at the size where uploads carry CRC32


def _ck(endpoint: str, bucket: str) -> Checkpointer:
    return Checkpointer(f"s3://{bucket}/ckpts?endpoint={endpoint}", "r", chunk_bytes=CHUNK)


def test_chunks_are_streamed_with_a_crc32_and_small_objects_keep_sha256(s3_endpoint, s3_bucket, monkeypatch):
    state = {"w": torch.randn(3 * CHUNK // 4)}  # 3 chunks
    hashed: list[int] = []
    real = s3_body.sha256_b64
    monkeypatch.setattr(s3_body, "sha256_b64", lambda views: hashed.append(sum(len(v) for v in views)) or real(views))
    puts: list[dict] = []
    with _ck(s3_endpoint, s3_bucket) as ck:
        ck.chunks.store.client.meta.events.register(
            "provide-client-params.s3.PutObject", lambda params, **_: puts.append(dict(params))
        )
        ck.save(1, state, kind="full", rng=False)
        chunk_puts = [p for p in puts if p["Key"].startswith("ckpts/chunks/")]
        assert len(chunk_puts) == 3
        for put in chunk_puts:
            assert isinstance(put["Body"], BuffersReader) and put["ContentLength"] > CHUNK
            assert "ChecksumCRC32" in put and "ChecksumSHA256" not in put
        manifest_puts = [p for p in puts if p["Key"].endswith("manifest.json")]
        assert manifest_puts and all("ChecksumSHA256" in p for p in manifest_puts)
        assert max(hashed) < s3_body.STRONG_BELOW  # no chunk was hashed with SHA-256
        fresh = {"w": torch.zeros(3 * CHUNK // 4)}
        ck.restore(fresh, step=1)
        assert torch.equal(fresh["w"], state["w"])


def test_reusing_the_previous_saves_chunk_costs_a_ranged_get_and_a_copy(s3_endpoint, s3_bucket):
    state = {"w": torch.randn(CHUNK), "frozen": torch.randn(CHUNK)}  # 4 chunks each
    calls: Counter = Counter()
    with _ck(s3_endpoint, s3_bucket) as ck:
        ck.save(1, state, kind="full", rng=False)
        ck.chunks.store.client.meta.events.register(
            "before-call.s3", lambda event_name, **_: calls.update([event_name.rsplit(".", 1)[-1]])
        )
        state["w"][0] += 1.0  # one chunk changed; 7 reused
        info = ck.save(2, state, kind="incremental", rng=False).info
        assert info is not None and info.bytes_written == CHUNK
        assert calls["CopyObject"] == 7, calls  # one touch per reused chunk
        assert calls["HeadObject"] <= 2, calls  # for the commit's own checks; was one more per reused chunk
        fresh = {"w": torch.zeros(CHUNK), "frozen": torch.zeros(CHUNK)}
        ck.restore(fresh, step=2)
        assert torch.equal(fresh["w"], state["w"]) and torch.equal(fresh["frozen"], state["frozen"])


def test_the_stream_reads_seeks_and_rereads_the_buffers_as_one():
    views = [memoryview(b"head"), memoryview(b""), memoryview(bytearray(b"0123456789"))]
    reader = BuffersReader(views)
    assert reader.read() == b"head0123456789" and reader.tell() == 14
    reader.seek(2)
    assert reader.read(5) == b"ad012"
    reader.seek(-3, 2)
    assert reader.read() == b"789"
    reader.seek(0)
    out = bytearray(100)
    assert reader.readinto(out) == 14 and bytes(out[:14]) == b"head0123456789"
    assert s3_body.crc32_b64(views) == s3_body.crc32_b64([memoryview(b"head0123456789")])
