# Sourced by the simulated-cluster tests (tests/test_sim_cluster*.sh): skip() and fail(), and
# the checks that this machine can start a simulated cluster (root, the tools, network
# namespaces), each skipping with its reason (exit 77) where it cannot.
skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAILED: $*"; exit 1; }
((EUID == 0)) || skip "needs root (network namespaces, veth pairs, tc)"
for tool in ip tc unshare mpirun; do
  command -v "$tool" >/dev/null || skip "'$tool' not found (iproute2, util-linux, openmpi-bin)"
done
# `ip netns exec` makes / a slave mount, which fails where / is not a mount point (a chroot such
# as scripts/check-fresh-install.sh's root): checked before `ip netns add` mounts /run/netns.
mountpoint -q / || skip "/ is not a mount point here (a chroot?): ip netns exec cannot make it a slave mount"
probe_ns=sigma-simtest-$$
ip netns add "$probe_ns" 2>/dev/null || skip "cannot create a network namespace here (ip netns add)"
ip netns del "$probe_ns"
