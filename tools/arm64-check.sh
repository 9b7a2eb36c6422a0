#!/usr/bin/env bash
# A Raspberry Pi OS 64-bit client, checked on an x86_64 Debian host: builds an arm64 Debian bookworm root (what
# Raspberry Pi OS 64-bit is) under qemu-user-static, installs fedge's device install there from wheels downloaded on
# the host for aarch64 (the offline path of docs/raspberry-pi.md), runs `fedge doctor` in it, then one short
# federation on the embedded broker with one arm64 client beside two host clients, each on its own .npz. Prints the
# download and install sizes, `import torch` time and RSS under emulation, and whether every client trained every
# round it was selected (all are, every round). Exit status 0: every check passed; 1: a check failed; 2: bad usage or host.
#
#   sudo tools/arm64-check.sh                     # from nothing ~20-30 min; with the cached root, minutes
#   sudo tools/arm64-check.sh --torch-index URL   # where the aarch64 torch comes from (default: PyTorch's CPU index)
#   sudo tools/arm64-check.sh --pi 5              # emulate a Pi 5's Cortex-A76 (ARMv8.2) instead of a Pi 4's A72
#
# Run as root on Debian/Ubuntu x86_64 with network access to deb.debian.org, PyPI and the torch index. The arm64 root
# is cached as a tarball in $FEDGE_ARM64_CACHE (default /var/cache/fedge-arm64); the wheels and the work folder are
# removed at the end (--keep keeps the work folder). Emulation is 20-50x slower than a real Pi 4: its timings are a
# functional check, never a speed figure. Not part of `make test`.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${FEDGE_ARM64_CACHE:-/var/cache/fedge-arm64}
MIRROR=${FEDGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_INDEX=https://download.pytorch.org/whl/cpu
PY=3.11 # bookworm's Python, the Pi's
ROUNDS=2
PI=4
KEEP=0
STEP_TIMEOUT=${FEDGE_ARM64_STEP_TIMEOUT:-3600} # seconds any one step may take (emulated pip and torch are slow)

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
        --torch-index) TORCH_INDEX=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --pi) PI=$2; shift 2 ;;
        --keep) KEEP=1; shift ;;
        -h|--help) usage ;;
        *) echo "arm64-check: unknown argument $1" >&2; usage ;;
    esac
done
# qemu's model of the Pi's CPU, and the Features line its Linux shows (the A72 is ARMv8.0: no `atomics`)
case $PI in
    4) QEMU_CPU=cortex-a72 PART=0xd08 FEATURES="fp asimd evtstrm crc32 cpuid" ;;
    5) QEMU_CPU=cortex-a76 PART=0xd0b FEATURES="fp asimd evtstrm crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp" ;;
    *) echo "arm64-check: --pi takes 4 or 5" >&2; exit 2 ;;
esac
TORCH_SPEC=$(grep -o '"torch==[^"]*"' "$REPO/pyproject.toml" | tr -d '"') ||
    { echo "arm64-check: no torch==... requirement in $REPO/pyproject.toml" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "arm64-check: run as root (debootstrap, chroot, mounts)" >&2; exit 2; }
[ "$(uname -m)" = x86_64 ] || { echo "arm64-check: needs an x86_64 host, this is $(uname -m)" >&2; exit 2; }
command -v apt-get >/dev/null || { echo "arm64-check: needs a Debian or Ubuntu host (apt-get)" >&2; exit 2; }

WORK=$(mktemp -d /tmp/fedge-arm64.XXXXXX)
ROOT=$WORK/root
WHEELS=$WORK/wheels
PIDS=()
say() { printf '[arm64-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { say "FAIL: $*"; exit 1; }
mb() { du -sm "$1" | cut -f1; }
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    for m in proc/cpuinfo proc sys dev; do
        if mountpoint -q "$ROOT/$m" 2>/dev/null; then umount "$ROOT/$m" || umount -l "$ROOT/$m"; fi
    done
    # --one-file-system: never into a mount that is still there (the host's /dev or /sys)
    if [ "$KEEP" = 1 ]; then say "kept $WORK"; else rm -rf --one-file-system "$WORK"; fi
}
trap cleanup EXIT
in_root() { timeout "$STEP_TIMEOUT" chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/bin:/bin QEMU_CPU=$QEMU_CPU "$@"; }

say "host: $(. /etc/os-release; echo "$PRETTY_NAME"), $(nproc) cores; work folder $WORK"
need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
[ -e /usr/libexec/qemu-binfmt/aarch64-binfmt-P ] || [ -e /usr/bin/qemu-aarch64-static ] || need+=(qemu-user-static)
command -v update-binfmts >/dev/null || need+=(binfmt-support)
if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    timeout 900 apt-get install -y -q "${need[@]}" >/dev/null
fi
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 || fail "qemu-aarch64 is registered without the F flag"

# 1. The arm64 root: Debian bookworm minbase with Python, built once and kept as a tarball.
TARBALL=$CACHE/bookworm-arm64-python$PY.tar.gz
mkdir -p "$ROOT" "$CACHE"
if [ -f "$TARBALL" ]; then
    say "arm64 root from $TARBALL"
    tar -xzf "$TARBALL" -C "$ROOT"
else
    say "debootstrap arm64 bookworm (once; emulated, ~10-15 min)"
    timeout "$STEP_TIMEOUT" debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap"; }
    rm -rf "$ROOT"/var/cache/apt/archives/*.deb
    tar -czf "$TARBALL.tmp" -C "$ROOT" . && mv "$TARBALL.tmp" "$TARBALL"
fi
mount -t proc proc "$ROOT/proc"
mount --bind /sys "$ROOT/sys"
mount --bind /dev "$ROOT/dev"
# qemu-user before 8.1 (Debian bookworm's is 7.2) shows the host's x86 /proc/cpuinfo, on which torch's cpuinfo
# crashes: show the Pi's (qemu 8.1 and later make up an arm one of their own, and this mount does not apply).
CPUINFO=$WORK/cpuinfo
for i in 0 1 2 3; do
    printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: %s\nCPU implementer\t: 0x41\n' "$i" "$FEATURES"
    printf 'CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: %s\nCPU revision\t: 3\n\n' "$PART"
done >"$CPUINFO"
mount --bind "$CPUINFO" "$ROOT/proc/cpuinfo"
say "device: Raspberry Pi $PI ($QEMU_CPU), $(in_root /usr/bin/python3 -c 'import platform; print(platform.machine(), platform.python_version())')"

# 2. On the host: fedge's wheel and every wheel a device install needs, for aarch64 and the device's Python.
mkdir -p "$WHEELS"
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 # as a user's host: no local mirrors or caps
HOSTPY=$(command -v python3)
say "building fedge's wheel"
timeout "$STEP_TIMEOUT" "$HOSTPY" -m pip wheel -q --no-deps -w "$WHEELS" "$REPO" >/dev/null
# every wheel tag the device's pip accepts: bookworm's glibc 2.36 runs manylinux_2_17 (manylinux2014) to 2_36
AARCH64=(--python-version "$PY" --implementation cp --only-binary=:all: -d "$WHEELS" --platform manylinux2014_aarch64)
for v in $(seq 17 36); do AARCH64+=(--platform "manylinux_2_${v}_aarch64"); done
say "downloading $TORCH_SPEC for aarch64 from $TORCH_INDEX"
timeout "$STEP_TIMEOUT" "$HOSTPY" -m pip download -q "${AARCH64[@]}" --no-deps --index-url "$TORCH_INDEX" "$TORCH_SPEC" ||
    fail "no aarch64 wheel of $TORCH_SPEC at $TORCH_INDEX (reachable from here? --torch-index chooses another)"
say "downloading the rest of the device install for aarch64 from PyPI"
# the torch wheel just downloaded, named as a requirement: PyPI's torch of a later 2.13 patch must not replace it
timeout "$STEP_TIMEOUT" "$HOSTPY" -m pip download -q "${AARCH64[@]}" --find-links "$WHEELS" "$WHEELS"/fedge-*.whl \
    "$WHEELS"/torch-*.whl
DOWNLOAD_MB=$(mb "$WHEELS")
say "wheels: $(ls "$WHEELS" | wc -l) files, $DOWNLOAD_MB MB: $(ls "$WHEELS" | sed 's/-[0-9].*//' | sort -u | tr '\n' ' ')"

# 3. On the device, offline: a venv and `pip install --no-index --find-links`.
cp -r "$WHEELS" "$ROOT/tmp/wheels"
say "installing fedge on the device, offline (emulated pip)"
in_root /usr/bin/python3 -m venv /opt/fedge/.venv
in_root /opt/fedge/.venv/bin/pip install -q --no-index --find-links /tmp/wheels fedge || fail "the offline install"
VENV_MB=$(mb "$ROOT/opt/fedge/.venv")
PEAK_DISK_MB=$((DOWNLOAD_MB + VENV_MB)) # the wheels and the venv are on the device together at the end
rm -rf "$ROOT/tmp/wheels"
say "installed: venv $VENV_MB MB; wheels and venv together (the peak on the device): $PEAK_DISK_MB MB"
in_root /opt/fedge/.venv/bin/pip list 2>/dev/null | sed 's/^/    /' || true

# 4. fedge doctor on the device: the torch build, import time and RSS (emulated), what a Pi 4 can train.
say "fedge doctor --profile rpi-$PI on the device"
DOCTOR=0
in_root /opt/fedge/.venv/bin/fedge doctor --profile "rpi-$PI" --json >"$WORK/doctor.json" 2>"$WORK/doctor.err" || DOCTOR=$?
grep '^fedge' "$WORK/doctor.err" | sed 's/^/    /' || true

# 5. One federation: embedded broker, server and two clients on the host, client 2 in the arm64 root.
say "federation: $ROUNDS rounds, 3 clients (client 2 on arm64), each on its own .npz"
DATA=$ROOT/data
mkdir -p "$DATA" "$WORK/run"
HOSTFEDGE=${FEDGE:-$REPO/.venv/bin/fedge}
[ -x "$HOSTFEDGE" ] || HOSTFEDGE=$(command -v fedge) || fail "no fedge on the host (make install, or FEDGE=path)"
"$(dirname "$HOSTFEDGE")/python" - "$DATA" "${FEDGE_MNIST:-$REPO/../shared/data/mnist.npz}" <<'EOF'
import sys
from pathlib import Path

import numpy as np

out, source = Path(sys.argv[1]), Path(sys.argv[2])
rng = np.random.default_rng(0)
if source.exists():
    with np.load(source, allow_pickle=False) as d:
        x, y = d["x_train"], d["y_train"]
else:  # no dataset beside the checkout: a learnable synthetic task (class k lights row band k)
    y = rng.integers(0, 10, 3000)
    x = rng.integers(0, 64, (3000, 28, 28)).astype(np.uint8)
    for k in range(10):
        x[y == k, 2 * k + 4 : 2 * k + 7, :] = 255
picked = rng.permutation(len(x))[: 3 * 240]
for client in range(3):
    part = picked[client * 240 : (client + 1) * 240]
    np.savez(out / f"{client}.npz", x_train=x[part[:200]], y_train=y[part[:200]], x_test=x[part[200:]], y_test=y[part[200:]])
EOF
PORT=$((20000 + RANDOM % 20000))
cat >"$ROOT/run.json" <<EOF
{"zoo": "cnn1", "strategy": "fedavg", "clients": 3, "active": 3, "rounds": $ROUNDS, "local_epochs": 1,
 "run_id": "arm64", "profiles": ["rpi-$PI"], "data_dir": "/data/{id}.npz", "input_shape": [1, 28, 28],
 "class_names": ["0","1","2","3","4","5","6","7","8","9"], "norm_mean": [0.13], "norm_std": [0.31],
 "register_timeout_s": 1800, "round_deadline_s": 1800, "heartbeat_s": 30}
EOF
printf 'server:s%s\n0:a%s\n1:b%s\n2:c%s\n' "$RANDOM$RANDOM" "$RANDOM" "$RANDOM" "$RANDOM" >"$ROOT/passwords"
chmod 600 "$ROOT/passwords"
"$HOSTFEDGE" broker --port "$PORT" --users "$ROOT/passwords" >"$WORK/broker.log" 2>&1 &
PIDS+=($!)
sleep 3
timeout "$STEP_TIMEOUT" "$HOSTFEDGE" server --broker "mqtt://127.0.0.1:$PORT" --config "$ROOT/run.json" \
    --password-file "$ROOT/passwords" --out "$WORK/run/fedavg" --no-progress \
    >"$WORK/server.log" 2>&1 &
SERVER=$!
PIDS+=("$SERVER")
for id in 0 1; do
    timeout "$STEP_TIMEOUT" "$HOSTFEDGE" client --broker "mqtt://127.0.0.1:$PORT" --config "$ROOT/run.json" --id $id \
        --data-dir "$DATA/$id.npz" --password-file "$ROOT/passwords" >"$WORK/client$id.log" 2>&1 &
    PIDS+=($!)
done
# started directly, not through in_root, so that $! is timeout itself, which passes a kill on to the client
timeout "$STEP_TIMEOUT" chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/usr/bin:/bin QEMU_CPU="$QEMU_CPU" \
    /opt/fedge/.venv/bin/fedge client --broker "mqtt://127.0.0.1:$PORT" --config /run.json --id 2 \
    --data-dir /data/2.npz --password-file /passwords >"$WORK/client2.log" 2>&1 &
PIDS+=($!)
SERVED=0
wait "$SERVER" || SERVED=$?
[ "$SERVED" = 0 ] || { tail -20 "$WORK/server.log" "$WORK/client2.log"; fail "the server exited with $SERVED"; }

# 6. The verdict, from the run folder.
"$(dirname "$HOSTFEDGE")/python" - "$WORK/run/fedavg" "$WORK/doctor.json" "$DOWNLOAD_MB" "$VENV_MB" "$PEAK_DISK_MB" \
    "$DOCTOR" "$WORK/doctor.err" <<'EOF'
import json
import sys
from pathlib import Path

from launch.doctor import text

run, doctor_file, download, venv, peak, doctor_status, doctor_err = sys.argv[1:]
summary = json.loads((Path(run) / "summary.json").read_text())
rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
arm = [r for r in rows if r["client"] == "2"]
doctor = json.loads(Path(doctor_file).read_text()) if Path(doctor_file).stat().st_size else {}
torch = doctor.get("torch", {})
MB = 1e6
if doctor:
    print("fedge doctor --profile rpi-4 on the device:\n" + "\n".join("    " + line for line in text(doctor).splitlines()))
print(f"install: wheels downloaded {download} MB, venv {venv} MB, peak disk {peak} MB")
if torch:
    print(
        f"torch {torch['build']['version']} ({torch['kind']}) on arm64 under emulation: import "
        f"{torch['import_seconds']:.1f} s, RSS {torch['rss_after_import'] / MB:.0f} MB after import, "
        f"{torch['rss_after_training'] / MB:.0f} MB after training steps; CUDA libraries mapped: "
        f"{len(torch['cuda_libraries'])}"
    )
peak_rss = max((r.get("peak_rss_bytes", 0) for r in arm), default=0)
print(f"arm64 client: {sum(r['trained'] for r in arm)} of {len(arm)} rounds trained, peak RSS {peak_rss / MB:.0f} MB")
print(f"final accuracy per client: {summary['final_accuracy']['per_client']}")
problems = []
if doctor_status != "0":
    said = doctor.get("problems") or [line for line in Path(doctor_err).read_text().splitlines() if line.startswith("fedge")]
    problems.append(f"fedge doctor found problems: {said}")
if summary["never_trained"] or summary["rejected_replies"]:
    problems.append(f"never trained {summary['never_trained']}, rejected {summary['rejected_replies']}")
if not arm or not all(r["trained"] for r in arm):
    problems.append("the arm64 client did not train every round it was selected")
untrained = sorted({(r["round"], r["client"]) for r in rows if not r["trained"]})
if untrained:
    problems.append(f"(round, client) selected and not trained: {untrained}")
print("PASS" if not problems else "FAIL: " + "; ".join(problems))
sys.exit(1 if problems else 0)
EOF
