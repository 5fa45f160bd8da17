#!/bin/sh
# Run each selected test in a pytest process of its own:
#   sh one_process_per_test.sh PYTHON PYTEST-ARGS...
# memfabric keeps a closed memcache client's mappings of other clients' memory for the
# life of the process, so a later client there can collide with them (memcache's own model
# is one client per process): the memcache tests that create clients in the test process
# run one per process. Fails if any fails or if none was selected.
set -uf  # -f: test ids hold [brackets], never globs
py=$1
shift
ids=$("$py" -m pytest -q -p no:cacheprovider --collect-only "$@" | grep "::")
[ -n "$ids" ] || { echo "no test selected"; exit 1; }
status=0
for t in $ids; do
    "$py" -m pytest -q -p no:cacheprovider "$t" || status=1
done
exit $status
