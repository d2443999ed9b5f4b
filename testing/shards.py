"""Bazel test sharding for a unittest main: `shards.main()` in place of `unittest.main()`.

Under a test target with shard_count = N, Bazel runs the target N times at once, each with
TEST_TOTAL_SHARDS = N and its TEST_SHARD_INDEX; each run takes every N-th test of the
module, in the order of their ids (module.Class.test_name), so the shards are disjoint and
together run every test. Elsewhere (no sharding, or command-line arguments given) it is
unittest.main() itself."""
import os
import sys
import unittest


def _tests(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _tests(item)
        else:
            yield item


def main(module="__main__"):
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total <= 1 or len(sys.argv) > 1:
        unittest.main(module=module)
        return
    index = int(os.environ["TEST_SHARD_INDEX"])
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:  # tells Bazel that this test knows how to shard
        open(status, "a").close()
    tests = sorted(_tests(unittest.defaultTestLoader.loadTestsFromModule(sys.modules[module])),
                   key=lambda t: t.id())
    mine = [t for i, t in enumerate(tests) if i % total == index]
    print(f"shard {index + 1} of {total}: {', '.join(t.id().rsplit('.', 1)[-1] for t in mine)}",
          flush=True)
    result = unittest.TextTestRunner(verbosity=1).run(unittest.TestSuite(mine))
    sys.exit(0 if result.wasSuccessful() else 1)
