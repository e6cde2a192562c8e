from benchmarks.goodput.folded_summary import frame_key, summarize


def test_frames_are_keyed_by_function_and_file_without_line_or_site_packages():
    assert frame_key("read (/v/lib/python3.11/site-packages/grpc/aio/_call.py:123)") == "read (grpc/aio/_call.py)"
    assert frame_key("chunk (services/router/request_state.py:9)") == "chunk (services/router/request_state.py)"


def test_inclusive_counts_a_recursive_function_once_per_sample_and_self_counts_leaves():
    lines = ["main (a.py:1);f (a.py:2);f (a.py:3);g (b.py:4) 3",
             "main (a.py:1);h (b.py:9) 1",
             "garbage"]
    total, inclusive, leaves = summarize(lines)
    assert total == 4
    assert inclusive["main (a.py)"] == 4 and inclusive["f (a.py)"] == 3 and inclusive["h (b.py)"] == 1
    assert leaves == {"g (b.py)": 3, "h (b.py)": 1}
