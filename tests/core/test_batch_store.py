"""BatchStore's file listing: OpenAI's pagination (limit, after, order, purpose) over (created_at, id)."""

from edgecore.core.batch_store import BatchStore


def test_file_pages_walk_every_file_once_in_both_orders(tmp_path, monkeypatch):
    store = BatchStore(tmp_path)
    clock = iter([100, 100, 100, 101, 102, 102, 103])      # ties: the id breaks them
    monkeypatch.setattr("edgecore.core.batch_store.time.time", lambda: next(clock))
    names = ["file_z", "file_b", "file_y", "file_a", "file_x", "file_c", "file_w"]    # ids out of upload order
    ids = [store.add_file(n, f"{n}.jsonl", "batch" if i != 3 else "other", 1)["id"] for i, n in enumerate(names)]
    for ascending in (False, True):
        seen, after = [], None
        while True:
            page, more = store.list_files(after=after, limit=2, ascending=ascending)
            assert len(page) <= 2
            seen += [f["id"] for f in page]
            if not more:
                break
            after = page[-1]["id"]
        assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen))
        assert seen == (ids if ascending else ids[::-1])    # upload order, ties within a second included
    batch_only, more = store.list_files("batch")
    assert not more and "file_a" not in [f["id"] for f in batch_only] and len(batch_only) == 6
    page, more = store.list_files(after="file_nonexistent", limit=3)
    assert more and len(page) == 3          # an unknown cursor starts from the first
