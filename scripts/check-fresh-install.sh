#!/usr/bin/env bash
# Proves the README's two set-up commands work on a fresh minimal Debian 12 (bookworm).
#
# Builds (or reuses) a pristine minbase root with mmdebstrap, unpacks a fresh copy of it, puts a
# clean copy of the checkout in it, chroots in and runs, as root and with a clean environment,
# exactly the commands in README.md's ```sh blocks (read from the README, so this cannot drift
# from it): first the main job, then the test command (which reuses the build directory).
# Prints PASS/FAIL and the wall time of each command and of each stage (install-deps, configure,
# build, run/test); exits non-zero if any command fails. See docs/fresh-install.md.
#
# Usage: sudo scripts/check-fresh-install.sh [options]
#   --root DIR      cache dir (or ROOT=DIR): keeps base.tar (the pristine root), apt's .deb cache,
#                   the logs and, with --keep, the chroot. Without it a temp dir is used and
#                   removed at the end. Reusing DIR skips mmdebstrap; every run still starts
#                   from a fresh unpack of base.tar, so nothing installed by a run carries over.
#   --keep          keep the chroot (DIR/chroot, with build/ and runs/) after the run.
#   --rebuild-base  run mmdebstrap again even if DIR/base.tar exists.
#   --worktree      copy the working tree (tracked and untracked, not ignored) instead of HEAD.
#   --src DIR       the checkout to test (default: the one this script is in).
#   --no-shared     do not bind-mount ../shared (tests that read ../shared/data then skip).
# Environment: MIRROR (default http://deb.debian.org/debian), SECURITY_MIRROR
# (default http://deb.debian.org/debian-security), VARIANT (default minbase).
set -euo pipefail

# Run in a private mount namespace: the bind mounts below then vanish with this process even if
# it is killed without running its trap, and never show up on the host.
if [[ -z "${SIGMA_FRESH_NS:-}" ]] && command -v unshare >/dev/null; then
  SIGMA_FRESH_NS=1 exec unshare --mount --propagation private -- "$0" "$@"
fi

die() { echo "check-fresh-install: $*" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || die "needs root (mmdebstrap, chroot, mounts)"

root_dir="${ROOT:-}" keep=0 rebuild=0 worktree=0 use_shared=1
src="$(cd "$(dirname "$0")/.." && pwd)"
while (($#)); do
  case "$1" in
    --root) root_dir="$2"; shift 2 ;;
    --root=*) root_dir="${1#*=}"; shift ;;
    --keep) keep=1; shift ;;
    --rebuild-base) rebuild=1; shift ;;
    --worktree) worktree=1; shift ;;
    --src) src="$(cd "$2" && pwd)"; shift 2 ;;
    --no-shared) use_shared=0; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
mirror="${MIRROR:-http://deb.debian.org/debian}"
security_mirror="${SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
variant="${VARIANT:-minbase}"
for tool in mmdebstrap chroot tar git; do command -v "$tool" >/dev/null || die "$tool not found"; done
[[ -f "$src/README.md" ]] || die "no README.md in $src"

# The README's commands: the body of each ```sh block, one command per block.
mapfile -t cmds < <(awk '/^```sh[[:space:]]*$/ {on=1; next} /^```/ {on=0} on && NF' "$src/README.md")
((${#cmds[@]} == 2)) || die "expected 2 one-line \`\`\`sh blocks in README.md, found ${#cmds[@]} lines"
names=("main job" "tests")

temp_root=0
if [[ -z "$root_dir" ]]; then root_dir="$(mktemp -d /tmp/sigma-fresh.XXXXXX)"; temp_root=1; fi
mkdir -p "$root_dir"; root_dir="$(cd "$root_dir" && pwd)"
chroot_dir="$root_dir/chroot"
mounts=()  # mount points under the chroot, in mount order

mounted_under() {  # prints every mount point at or below $1
  awk -v p="$1" '$5 == p || index($5, p "/") == 1 {print $5}' /proc/self/mountinfo
}
unmount_all() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount -R "${mounts[i]}" 2>/dev/null || umount -Rl "${mounts[i]}" 2>/dev/null || true
  done
  mounts=()
}
remove_chroot() {  # never deletes through a mount: refuses while anything is mounted below it
  [[ -e "$chroot_dir" ]] || return 0
  if [[ -n "$(mounted_under "$chroot_dir")" ]]; then
    echo "check-fresh-install: still mounted under $chroot_dir, not removing it:" >&2
    mounted_under "$chroot_dir" >&2
    return 1
  fi
  rm -rf --one-file-system "$chroot_dir"
}
cleanup() {
  local rc=$?
  unmount_all
  if ((keep == 0)); then remove_chroot || rc=1; fi
  if ((temp_root)) && ((keep == 0)); then rm -rf --one-file-system "$root_dir"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

now() { date +%s; }
fmt_s() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

echo "== check-fresh-install: $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "   source: $src ($( ((worktree)) && echo "working tree of " )$(git -C "$src" rev-parse --short HEAD))"
echo "   root:   $root_dir ($variant, bookworm, $mirror)"

# 1. The pristine root, cached as a tarball.
base="$root_dir/base.tar"
if ((rebuild)) || [[ ! -s "$base" ]]; then
  t0=$(now)
  echo "== mmdebstrap --variant=$variant bookworm"
  mmdebstrap --quiet --mode=root --format=tar --variant="$variant" bookworm "$base.tmp" \
    "deb $mirror bookworm main" \
    "deb $mirror bookworm-updates main" \
    "deb $security_mirror bookworm-security main"
  mv "$base.tmp" "$base"
  echo "   base root built in $(fmt_s $(($(now) - t0))) ($(du -h "$base" | cut -f1))"
else
  echo "== reusing $base ($(du -h "$base" | cut -f1), built $(date -u -r "$base" +%FT%TZ))"
fi

# 2. A fresh unpack of it, the checkout, DNS, and the mounts.
remove_chroot || die "stale mounts under $chroot_dir"
mkdir -p "$chroot_dir"
tar -C "$chroot_dir" --numeric-owner -xpf "$base"
cp /etc/resolv.conf "$chroot_dir/etc/resolv.conf"
# Like DNS, the host's own trust anchors for its network: where outbound TLS passes through an
# intercepting proxy, the host trusts its CA in /usr/local/share/ca-certificates, and npm in
# the chroot needs the same to reach the registry. They take effect when install-deps installs
# ca-certificates (its postinst adds them to the bundle); a machine on the open internet has
# none and needs none.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  mkdir -p "$chroot_dir/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$chroot_dir/usr/local/share/ca-certificates/"
fi
mkdir -p "$chroot_dir/work/sigma"
if ((worktree)); then
  (cd "$src" && git ls-files -z --cached --others --exclude-standard |
     while IFS= read -r -d '' f; do [[ -e "$f" || -L "$f" ]] && printf '%s\0' "$f"; done |
     tar --null -T - -cf -) | tar -C "$chroot_dir/work/sigma" -xf -
else
  git -C "$src" archive --format=tar HEAD | tar -C "$chroot_dir/work/sigma" -xf -
fi

bind() {  # bind <host path> <path in chroot> [ro]
  mkdir -p "$chroot_dir$2"
  mount --rbind "$1" "$chroot_dir$2"; mounts+=("$chroot_dir$2")
  mount --make-rslave "$chroot_dir$2"
  if [[ "${3:-}" == ro ]]; then
    mount -o remount,bind,ro "$chroot_dir$2"
    touch "$chroot_dir$2/.rw-probe" 2>/dev/null && { rm -f "$chroot_dir$2/.rw-probe"; die "$2 is not read-only"; }
  fi
  return 0
}
mount -t proc proc "$chroot_dir/proc"; mounts+=("$chroot_dir/proc")
bind /sys /sys
bind /dev /dev
# apt's .deb cache lives outside the chroot so a rerun does not download again (apt-get update
# still fetches fresh indexes, so the versions installed are the mirror's current ones).
mkdir -p "$root_dir/apt-archives/partial"
bind "$root_dir/apt-archives" /var/cache/apt/archives
# Tests read ../shared/data next to the checkout; give it to them read-only at the same place.
shared="$(cd "$src/.." && pwd)/shared"
if ((use_shared)) && [[ -d "$shared" ]]; then
  bind "$shared" /work/shared ro
  echo "   ../shared: $shared, read-only"
else
  echo "   ../shared: not mounted (tests that need ../shared/data will skip)"
fi

# 3. The README's commands, as root in a login-like clean environment, from the checkout's root.
mkdir -p "$root_dir/logs"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
failed=0 summary=()
for i in 0 1; do
  log="$root_dir/logs/$stamp-$((i + 1)).log"
  # xtrace marks when each command of the && chain starts; the command itself is verbatim.
  printf '%s\n' 'cd /work/sigma' "PS4='+[\${SECONDS}s] '" 'set -x' "${cmds[i]}" > "$chroot_dir/work/cmd-$((i + 1)).sh"
  echo "== [$((i + 1))/2] ${names[i]}: ${cmds[i]}"
  t0=$(now)
  set +e
  chroot "$chroot_dir" /usr/bin/env -i HOME=/root USER=root LOGNAME=root SHELL=/bin/bash \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash "/work/cmd-$((i + 1)).sh" > "$log" 2>&1
  rc=$?
  set -e
  dt=$(($(now) - t0))
  # Stage times from the xtrace marks: each stage lasts until the next one starts.
  awk -v total="$dt" '
    /^\+\[[0-9]+s\] / { s = $1; gsub(/[^0-9]/, "", s); n++; start[n] = s; sub(/^\+\[[0-9]+s\] /, ""); what[n] = substr($0, 1, 60) }
    END { for (k = 1; k <= n; k++) { e = (k < n) ? start[k + 1] : total; printf "     %4ds  %s\n", e - start[k], what[k] } }' "$log"
  if ((rc == 0)); then
    result="PASS"
  else
    result="FAIL (exit $rc)"; failed=1
    echo "---- last 40 lines of $log"; tail -n 40 "$log"; echo "----"
  fi
  if ((i == 0)); then
    tail -n 15 "$log" | sed 's/^/     | /'
  else
    grep -E 'tests passed|tests failed out of|Total Test time|\*\*\*Skipped|\*\*\*Failed|Not Run' "$log" | sed 's/^/     | /' || true
  fi
  line="$result  ${names[i]}  $(fmt_s "$dt")  (log: $log)"
  echo "   $line"; summary+=("$line")
done

echo "== summary"
printf '   %s\n' "${summary[@]}"
((keep)) && echo "   chroot kept at $chroot_dir ($(du -sh --one-file-system "$chroot_dir" 2>/dev/null | cut -f1))"
((temp_root)) && ((keep == 0)) && echo "   (temp root $root_dir removed, logs with it)"
exit "$failed"
