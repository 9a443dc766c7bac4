# Shared set-up for scripts/run and scripts/test (sourced, not run): what a fresh Debian machine
# of this kind lacks is installed, and what is slow to make is made once into a cache outside the
# clone ($KVCACHED_CACHE, default ~/.cache/kvcached) that later runs and later clones reuse.

KVCACHED_CACHE="${KVCACHED_CACHE:-$HOME/.cache/kvcached}"
export KVCACHED_CACHE
# Build outputs outside the clone too, so that a fresh clone on the same machine is incremental.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$KVCACHED_CACHE/target}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ -t 2 ]; then
  say() { printf '\033[1m==>\033[0m %s\n' "$*" >&2; }
else
  say() { printf '==> %s\n' "$*" >&2; }
fi
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# need_debs PKG...: installs the Debian packages that are missing (as root, or through sudo
# without a password); otherwise stops with the one command to run.
need_debs() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing system packages ${missing[*]} and no apt-get here: install them, then run this again"
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      sudo=(sudo)
    else
      die "missing system packages: run  sudo apt-get install -y ${missing[*]}  then this again"
    fi
  fi
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq >/dev/null
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# need_rust: cargo must be there (the machine's one toolchain; nothing else can be fetched).
need_rust() {
  command -v cargo >/dev/null || die "cargo not found: install Rust 1.95 (https://rustup.rs), then run this again"
}

# ensure_rocksdb: RocksDB's C++ library, built once per version into the cache and linked by every
# build profile (.cargo/config.toml points ROCKSDB_LIB_DIR at the link .rocksdb made here).
# Without it each profile (debug for tests, release for the daemon) compiled RocksDB again, ~9
# minutes each on 2 cores.
ensure_rocksdb() {
  local ver dir build lib
  ver="$(awk '/^name = "librocksdb-sys"$/ { getline; gsub(/"/, "", $3); print $3 }' "$REPO/Cargo.lock")"
  [ -n "$ver" ] || die "librocksdb-sys not found in Cargo.lock"
  dir="$KVCACHED_CACHE/rocksdb/$ver"
  if [ ! -f "$dir/librocksdb.a" ]; then
    build="$KVCACHED_CACHE/rocksdb-build"
    say "building RocksDB ($ver) once into $dir: about 15 minutes on 2 cores; later runs reuse it"
    (cd "$REPO" && ROCKSDB_COMPILE=1 CARGO_TARGET_DIR="$build" cargo build --release --locked -q -p librocksdb-sys) \
      || die "the RocksDB build failed (see above)"
    lib="$(ls -t "$build"/release/build/librocksdb-sys-*/out/librocksdb.a 2>/dev/null | head -n1)"
    [ -f "$lib" ] || die "the RocksDB build left no librocksdb.a under $build"
    mkdir -p "$dir"
    cp "$lib" "$dir/librocksdb.a.tmp" && mv "$dir/librocksdb.a.tmp" "$dir/librocksdb.a"
    rm -rf "$build"
  fi
  ln -sfn "$dir" "$REPO/.rocksdb"
}

# ensure_build_deps: everything `cargo build` needs on a fresh machine.
ensure_build_deps() {
  need_rust
  # libclang: RocksDB's bindings are generated at build time (bindgen).
  need_debs libclang-dev
  ensure_rocksdb
}

# venv DIR PKG...: a Python virtual environment in the cache with these PyPI packages, made on
# first use; prints its python.
venv() {
  local dir="$KVCACHED_CACHE/$1"; shift
  local stamp="$dir/.kvcached-packages" want="$*"
  if [ ! -x "$dir/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    python3 -c 'import venv, ensurepip' 2>/dev/null || need_debs python3-venv
    say "creating the Python environment $dir ($want)"
    rm -rf "$dir"
    python3 -m venv "$dir"
    "$dir/bin/pip" install -q --disable-pip-version-check --progress-bar off "$@"
    printf '%s' "$want" >"$stamp"
  fi
  printf '%s\n' "$dir/bin/python"
}
