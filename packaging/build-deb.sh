#!/usr/bin/env bash
# Builds dist/gpud_<version>-1_<arch>.deb for the release it runs on (Debian 12, Ubuntu 24.04 or 22.04:
# any python3 >= 3.10; the package then depends on that python3.X): a virtualenv of its python3 at
# /opt/gpud holding gpud and its dependencies (from PyPI at build time), /usr/bin links, the
# systemd units, sysusers/tmpfiles snippets and /etc/gpud/layout.yaml (conffile).
#
# The venv is built under a staging root and made to live at /opt/gpud: its scripts' shebangs
# are rewritten and the bytecode is compiled for /opt/gpud paths (hash-checked, so it does not
# depend on file times), since /opt is read-only to the sandboxed daemon and it cannot write
# __pycache__ itself.
#
#   packaging/build-deb.sh            # -> dist/gpud_0.1.0-1_amd64.deb
#   PYTHON=/usr/bin/python3.11 OUT=/tmp packaging/build-deb.sh
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-/usr/bin/python3}  # the release's own python3: Debian 12 3.11, Ubuntu 24.04 3.12, 22.04 3.10
OUT=${OUT:-$REPO/dist}
PREFIX=/opt/gpud
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpud-deb.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
STAGE=$WORK/root

for tool in dpkg-deb "$PYTHON"; do
  command -v "$tool" >/dev/null || { echo "build-deb: $tool not found" >&2; exit 1; }
done
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "build-deb: $PYTHON is older than 3.10, which gpud needs" >&2; exit 1; }
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || { echo "build-deb: $PYTHON lacks venv/ensurepip (apt install python3-venv)" >&2; exit 1; }
case "$("$PYTHON" -c 'import sys; print(sys.prefix)')" in
  /usr) ;;
  *) echo "build-deb: $PYTHON is not the release's python (the venv must point at /usr/bin/python3.X on the target)" >&2; exit 1 ;;
esac

VERSION=$("$PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import re, sys  # no tomllib before 3.11
print(re.search(r'^version = "([^"]+)"', open(sys.argv[1]).read(), re.M)[1])
EOF
)
DEBVERSION="$VERSION-1"
ARCH=$(dpkg --print-architecture)
PYVER=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

echo "build-deb: gpud $DEBVERSION ($ARCH, python $PYVER)"

# 1. the wheel of this tree, then the venv with it and its dependencies
"$PYTHON" -m venv "$WORK/buildenv"
"$WORK/buildenv/bin/pip" install -q build
# Build from a copy, so nothing (build/, *.egg-info) is written into the working tree.
mkdir -p "$WORK/src"
tar -C "$REPO" --exclude=./.venv --exclude=./.git --exclude=./dist --exclude=./build \
  --exclude='*.egg-info' --exclude=__pycache__ --exclude=.hypothesis -cf - . | tar -C "$WORK/src" -xf -
"$WORK/buildenv/bin/python" -m build -q --wheel --outdir "$WORK/wheels" "$WORK/src" >/dev/null
mkdir -p "$STAGE$PREFIX"
"$PYTHON" -m venv "$STAGE$PREFIX"
# With the [kube] extra (lightkube) on disk, so `gpud --kube-node` works from the package; the
# daemon imports it only in that mode.
WHEEL=$(ls "$WORK"/wheels/gpud-*.whl)
"$STAGE$PREFIX/bin/pip" install -q --no-compile "$WHEEL[kube]"
"$STAGE$PREFIX/bin/pip" uninstall -q -y pip setuptools >/dev/null 2>&1 || true
rm -rf "$STAGE$PREFIX/bin/pip"* "$STAGE$PREFIX"/bin/activate* "$STAGE$PREFIX/bin/Activate.ps1"
# Only gpud's own commands and the interpreter stay in bin/: the scripts the dependencies install
# (httpx, ...) are no commands of this package
for f in "$STAGE$PREFIX"/bin/*; do
  case "$(basename "$f")" in
    gpud|gpudctl|gpud-sim|python|python3|python3.*) ;;
    *) rm -f "$f" ;;
  esac
done

# 2. make it live at /opt/gpud
for f in "$STAGE$PREFIX"/bin/*; do
  [ -f "$f" ] && [ ! -L "$f" ] && sed -i "1s|^#!.*$|#!$PREFIX/bin/python$PYVER|" "$f"
done
grep -rl --null "$STAGE" "$STAGE$PREFIX" 2>/dev/null | xargs -0 -r sed -i "s|$STAGE||g"
if grep -rq "$STAGE" "$STAGE$PREFIX"; then
  echo "build-deb: staging path left in:" >&2; grep -rl "$STAGE" "$STAGE$PREFIX" >&2; exit 1
fi
# gpudctl: a launcher with the interpreter and the one site-packages directory written in (-I -S),
# over the script pip installed (packaging/gpudctl-pip.in, which finds both at run time, through sh).
SITE=$PREFIX/lib/python$PYVER/site-packages
sed -e "s|@PYTHON@|$PYTHON|" -e "s|@PATHS@|['$SITE']|" "$REPO/packaging/gpudctl.in" >"$STAGE$PREFIX/bin/gpudctl"
chmod 0755 "$STAGE$PREFIX/bin/gpudctl"
"$STAGE$PREFIX/bin/python" -m compileall -q -j0 --invalidation-mode checked-hash \
  -s "$STAGE" -p / "$STAGE$PREFIX/lib" >/dev/null

# 3. the rest of the file system
install -d "$STAGE/usr/bin" "$STAGE/usr/lib/systemd/system" "$STAGE/usr/lib/sysusers.d" \
  "$STAGE/usr/lib/tmpfiles.d" "$STAGE/etc/gpud" "$STAGE/usr/share/doc/gpud"
for cmd in gpud gpudctl gpud-sim; do
  [ -x "$STAGE$PREFIX/bin/$cmd" ] || { echo "build-deb: $cmd missing from the venv" >&2; exit 1; }
  ln -s "$PREFIX/bin/$cmd" "$STAGE/usr/bin/$cmd"
done
install -m 0644 "$REPO/systemd/gpud.service" "$REPO/systemd/gpud.socket" "$STAGE/usr/lib/systemd/system/"
install -m 0644 "$REPO/packaging/sysusers.d/gpud.conf" "$STAGE/usr/lib/sysusers.d/gpud.conf"
install -m 0644 "$REPO/packaging/tmpfiles.d/gpud.conf" "$STAGE/usr/lib/tmpfiles.d/gpud.conf"
install -m 0644 "$REPO/etc/gpud/layout.yaml" "$STAGE/etc/gpud/layout.yaml"
if [ -d "$REPO/etc/gpud/examples" ]; then
  cp -r "$REPO/etc/gpud/examples" "$STAGE/usr/share/doc/gpud/examples"
fi
install -m 0644 "$REPO/README.md" "$STAGE/usr/share/doc/gpud/README.md"
install -m 0644 "$REPO/packaging/kube/gpud-rbac.yaml" "$STAGE/usr/share/doc/gpud/gpud-rbac.yaml"   # kubectl apply -f (README: Kubernetes)
cat > "$STAGE/usr/share/doc/gpud/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: gpud
License: Apache-2.0
 The bundled Python packages under $PREFIX carry their own licenses in their .dist-info.
EOF

# 4. control files
# Who answers for this build: DEBFULLNAME/DEBEMAIL as Debian's tools take them, else the project's
# maintainers entry in pyproject.toml (the build needs no git: a stock machine may have none)
PROJECT_MAINTAINER=$("$PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import re, sys  # no tomllib before 3.11
m = re.search(r'^maintainers = \[\{ name = "([^"]+)", email = "([^"]+)" \}\]', open(sys.argv[1]).read(), re.M)
print(f"{m[1]} <{m[2]}>" if m else "")
EOF
)
if [ -n "${DEBFULLNAME:-}" ] && [ -n "${DEBEMAIL:-}" ]; then
  MAINTAINER="$DEBFULLNAME <$DEBEMAIL>"
else
  MAINTAINER=$PROJECT_MAINTAINER
fi
[ -n "$MAINTAINER" ] || { echo "build-deb: set DEBFULLNAME and DEBEMAIL (pyproject.toml names no maintainers)" >&2; exit 1; }
install -m 0644 "$REPO/LICENSE" "$STAGE/usr/share/doc/gpud/LICENSE"
install -d "$STAGE/DEBIAN"
SIZE=$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
cat > "$STAGE/DEBIAN/control" <<EOF
Package: gpud
Version: $DEBVERSION
Architecture: $ARCH
Maintainer: $MAINTAINER
Installed-Size: $SIZE
Depends: python$PYVER, systemd (>= 247)
Recommends: dbus
Section: admin
Priority: optional
Description: converges NVIDIA GPU drivers and MIG layouts to /etc/gpud/layout.yaml
 gpud is a root daemon that keeps each NVIDIA GPU of a host on the driver and MIG layout
 written in /etc/gpud/layout.yaml, drains GPU client units around disruptive steps, and
 serves its status to members of group gpud through gpudctl.
 .
 The shipped layout changes nothing until edited. Enable with: systemctl enable --now gpud
EOF
echo /etc/gpud/layout.yaml > "$STAGE/DEBIAN/conffiles"
install -m 0755 "$REPO/packaging/debian/postinst" "$REPO/packaging/debian/prerm" \
  "$REPO/packaging/debian/postrm" "$STAGE/DEBIAN/"

# md5sums of every file shipped outside DEBIAN (dpkg --verify and debsums check against them)
(cd "$STAGE" && find . -path ./DEBIAN -prune -o -type f -print0 | LC_ALL=C sort -z | xargs -0 md5sum \
  | sed 's|  \./|  |') > "$STAGE/DEBIAN/md5sums"
mkdir -p "$OUT"
DEB="$OUT/gpud_${DEBVERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zxz --build "$STAGE" "$DEB" >/dev/null
echo "$DEB"
