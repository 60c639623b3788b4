#!/bin/bash
# Run a command with its direct-I/O writes to the disk holding the current directory limited
# to MBPS megabytes per second by the kernel's block throttle (cgroup v1 blkio; needs root):
# a slower local disk (or a parallel file system client's share) on the same machine.
#     sudo bash benchmarks/throttled.sh 500 python benchmarks/codecs.py --repeated-saves
set -euo pipefail
mbps=$1; shift
dev=$(stat -c '%d' .)
majmin="$((dev >> 8)):$((dev & 255))"
parent=$(lsblk -no PKNAME "/dev/block/$majmin" 2>/dev/null || true)
[ -n "$parent" ] && majmin=$(lsblk -dno MAJ:MIN "/dev/$parent" | tr -d ' ')
group=/sys/fs/cgroup/blkio/forkpoint-throttled-$mbps
mkdir -p "$group"
echo "$majmin $((mbps * 1000000))" > "$group/blkio.throttle.write_bps_device"
echo "writes to $majmin limited to $mbps MB/s" >&2
echo $$ > "$group/cgroup.procs"
exec "$@"
