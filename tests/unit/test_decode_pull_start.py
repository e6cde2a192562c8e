"""services.decode.server.pull_start: where a decode worker holding a prompt's first tokens starts its pull."""

from __future__ import annotations

from distserve.transfer.checksum import ChunkChecksums
from distserve.v1 import common_pb2, kvbroker_pb2
from services.decode.server import pull_start


def handle(num_tokens: int, chunk: int = 64, crcs: int | None = None) -> kvbroker_pb2.KvHandle:
    count = -(-num_tokens // chunk) if crcs is None else crcs
    return kvbroker_pb2.KvHandle(layout=common_pb2.KvLayout(num_tokens=num_tokens), kv_crc32c=7,
                                 kv_chunk_crc32c=list(range(count)), kv_chunk_tokens=chunk)


def test_nothing_shared_pulls_everything_against_the_whole_checksum():
    assert pull_start(handle(300), 0) == (0, 7)


def test_a_shared_prefix_pulls_from_the_chunk_boundary_before_it_against_the_chunk_checksums():
    start, expected = pull_start(handle(300), 160)
    assert start == 128 and expected == ChunkChecksums(64, (0, 1, 2, 3, 4))


def test_a_prompt_shared_whole_still_pulls_its_last_chunk():
    assert pull_start(handle(256), 256)[0] == 192
    assert pull_start(handle(250), 240)[0] == 192


def test_a_share_under_one_chunk_or_a_handle_without_chunk_checksums_pulls_everything():
    assert pull_start(handle(300), 48) == (0, 7)
    assert pull_start(handle(300, crcs=0), 160) == (0, 7)
    assert pull_start(handle(300, crcs=3), 160) == (0, 7)  # a count that does not fit the layout
