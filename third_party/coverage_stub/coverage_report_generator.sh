#!/bin/sh
echo "memlean: coverage reports are not available offline (stub @remote_coverage_tools)" >&2
exit 1
