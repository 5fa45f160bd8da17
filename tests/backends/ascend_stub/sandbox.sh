#!/bin/sh
# Run a command where the real memcache_hybrid client can start without an NPU:
#   sh tests/backends/ascend_stub/sandbox.sh .venv/bin/python -m pytest ...
# (the Python with memcache_hybrid: the command's first word, or $ASCEND_STUB_PYTHON)
# It re-runs itself in private mount and network namespaces (root only), so nothing it
# sets up is seen outside: loopback only (memcache's servers bind every interface), a
# private /tmp (the meta service allows one per host through /tmp/mmc_meta_service.lock)
# and /dev/shm (host_shm's segments), and the driver files memfabric checks for, with
# driver_stub.c (built here with gcc) installed under the library names it loads.
set -eu
if [ "${ASCEND_STORE_STUB_NS:-}" != 1 ]; then
    ASCEND_STORE_STUB_NS=1 exec unshare -m -n sh "$0" "$@"
fi
here=$(cd "$(dirname "$0")" && pwd)
repo=$(pwd)
py=${ASCEND_STUB_PYTHON:-$1}
mount --make-rprivate /
ip link set lo up
# A private /tmp, but a checkout that lives under /tmp (a CI clone) stays where it is: the
# old /tmp is kept reachable and the checkout bound back into the new one.
old=$(mktemp -d /run/ascend-stub-tmp.XXXXXX 2>/dev/null || mktemp -d /var/tmp/ascend-stub-tmp.XXXXXX)
mount --bind /tmp "$old"
mount -t tmpfs tmpfs /tmp
for path in "$repo" "$here"; do
    case "$path" in
        /tmp/*) mkdir -p "$path" && mount --bind "$old${path#/tmp}" "$path" ;;
    esac
done
mount -t tmpfs tmpfs /dev/shm
stub=/tmp/ascend-stub
mkdir -p $stub/lib64 $stub/usr-local/up $stub/usr-local/work
gcc -shared -fPIC -O2 -Wall -Werror -o $stub/lib64/libascendcl.so "$here/driver_stub.c"
for name in libascend_hal libra libtsdclient libhccl libdcmi; do
    cp $stub/lib64/libascendcl.so $stub/lib64/$name.so
done
# The driver's version file, where memfabric looks when /etc/ascend_install.info is absent.
mount -t overlay overlay -o lowerdir=/usr/local,upperdir=$stub/usr-local/up,workdir=$stub/usr-local/work /usr/local
mkdir -p /usr/local/Ascend/driver
printf 'Version=25.3.rc1\nInnerversion=V100R001C23SPC005B219\n' > /usr/local/Ascend/driver/version.info
mf_lib=$("$py" -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('memfabric_hybrid').origin), 'lib'))")
export ASCEND_HOME_PATH=$stub
export LD_LIBRARY_PATH="$stub/lib64:$mf_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# host_tcp: otherwise every client sets up an 8.6 GB transfer buffer.
export MF_HCOM_MAX_SEND_RECV_DATA_CNT=256
export ASCEND_STORE_ASCEND_STUB=1 ASCEND_STORE_NETNS=1 MC_TCP_BIND_ADDRESS=127.0.0.1
exec "$@"
