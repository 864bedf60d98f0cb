#!/usr/bin/env bash
# Carry the GPU machine's Triton cache from one fresh machine to the next (each device machine
# starts bare, and compiling flashpd's kernels again costs the stack's first start 130-220 s:
# ready in 188-277 s cold against 50-60 s warm on the H200).
#
#   bash scripts/triton_cache.sh pack DEST [CACHE]   (on the GPU machine, e.g. DEST=$OUT) the
#       cache's loadable files only (each kernel's metadata .json and __grp__ group file, its
#       .cubin, the compiled launcher .so files; not the .ptx/.ttir/.ttgir/.llir/.source
#       intermediates Triton never reads on a hit), xz-compressed and split into parts of at
#       most PART_MB (9) MiB: DEST/triton_cache.part-aa, -ab, ... and DEST/triton_cache.sha256
#   bash scripts/triton_cache.sh unpack DIR [CACHE]   (on the next machine) once DIR holds every
#       part the .sha256 list names, checked, unpacks them into CACHE; otherwise says what is
#       missing (bring the parts over several calls, like .gpu_stack's)
#
# CACHE defaults to $TRITON_CACHE_DIR or ~/.triton/cache. Triton's group files name their
# children by absolute path, so the cache must land at the path it was packed from (the device
# machines run as root with the same home). A kernel whose files are missing or stale is simply
# compiled again: nothing here can make a kernel run wrong code, since Triton keys each entry by
# a hash of its source, options, target and Triton version.
set -euo pipefail
CMD=${1:?usage: triton_cache.sh pack DEST [CACHE] | unpack DIR [CACHE]}
WHERE=${2:?usage: triton_cache.sh pack DEST [CACHE] | unpack DIR [CACHE]}
CACHE=${3:-${TRITON_CACHE_DIR:-$HOME/.triton/cache}}
PART_MB=${PART_MB:-9}
case "$CMD" in
pack)
    [ -d "$CACHE" ] || { echo "triton_cache: no cache at $CACHE" >&2; exit 1; }
    CACHE=$(cd "$CACHE" && pwd -P)  # absolute: the archive holds the files' paths from /
    mkdir -p "$WHERE"
    rm -f "$WHERE"/triton_cache.part-* "$WHERE"/triton_cache.sha256
    list=$(mktemp)
    (cd / && find "${CACHE#/}" -type f \( -name '*.json' -o -name '*.cubin' -o -name '*.so' \) | sort) >"$list"
    (cd / && tar cf - -T "$list") | xz -6 -T0 | split -b "${PART_MB}M" - "$WHERE/triton_cache.part-"
    (cd "$WHERE" && sha256sum triton_cache.part-* >triton_cache.sha256)
    echo "triton_cache: $(wc -l <"$list") files of $CACHE -> $(ls "$WHERE"/triton_cache.part-* | wc -l) part(s) in $WHERE ($(du -ch "$WHERE"/triton_cache.part-* | tail -1 | cut -f1))"
    rm -f "$list"
    ;;
unpack)
    sums="$WHERE/triton_cache.sha256"
    [ -f "$sums" ] || { echo "triton_cache: no $sums" >&2; exit 1; }
    missing=""
    while read -r sum name; do
        if [ ! -f "$WHERE/$name" ] || [ "$(sha256sum "$WHERE/$name" | cut -d' ' -f1)" != "$sum" ]; then
            missing="$missing $name"
        fi
    done <"$sums"
    if [ -n "$missing" ]; then
        echo "triton_cache: still missing:$missing" >&2
        exit 0
    fi
    mkdir -p "$CACHE"
    cut -d' ' -f3 "$sums" | sed "s#^#$WHERE/#" | xargs cat | xz -d | (cd / && tar xf -)
    echo "triton_cache: unpacked $(find "$CACHE" -type f | wc -l) files into $CACHE"
    ;;
*)
    echo "triton_cache: unknown command $CMD (pack | unpack)" >&2
    exit 2
    ;;
esac
