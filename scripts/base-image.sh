#!/usr/bin/env bash
# The Debian bookworm base image that test tasks' `FROM` lines name, built here because no registry serves images
# on this network: `debootstrap --variant=minbase` from the host's own Debian mirror, `docker import`, then tagged
# with every name in BASE_IMAGE_TAGS. Idempotent: does nothing when every tag already exists (the first build takes
# about a minute). The host's CA bundle goes into the image, with PIP_CERT/REQUESTS_CA_BUNDLE/SSL_CERT_FILE pointing
# at it, because this network intercepts TLS: without it `pip install` in a `docker build` fails verification.
# Kept at its own path, not /etc/ssl/certs/ca-certificates.crt, which `apt-get install ca-certificates` rewrites.
set -euo pipefail
tags=${BASE_IMAGE_TAGS:-"debian:bookworm-slim debian:bookworm debian:12"}
missing=0
for tag in $tags; do docker image inspect "$tag" >/dev/null 2>&1 || missing=1; done
[ "$missing" = 0 ] && exit 0

command -v debootstrap >/dev/null || { echo "base-image.sh: debootstrap is not installed" >&2; exit 1; }
mirror=$(sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $1}' |
  grep -v security | head -n1)
mirror=${mirror:-$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
mirror=${mirror:-http://deb.debian.org/debian}
ca=/etc/ssl/certs/ca-certificates.crt
[ -f "$ca" ] || { echo "base-image.sh: no host CA bundle at $ca" >&2; exit 1; }

dir=$(mktemp -d /var/tmp/grpoflow-base.XXXXXX)
trap 'rm -rf "$dir"' EXIT
log=${BASE_IMAGE_LOG:-/tmp/grpoflow-base-image.log}
echo "base-image.sh: debootstrap bookworm from $mirror (log: $log)" >&2
if ! debootstrap --variant=minbase bookworm "$dir/root" "$mirror" >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "base-image.sh: debootstrap failed (full log: $log)" >&2
  exit 1
fi
install -D -m 0644 "$ca" "$dir/root/usr/local/share/grpoflow/host-ca.crt"
rm -rf "$dir/root/var/cache/apt/archives/"*.deb "$dir/root/var/lib/apt/lists/"*
cert=/usr/local/share/grpoflow/host-ca.crt
first=${tags%% *}
tar -C "$dir/root" -c . | docker import \
  --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change "ENV PIP_CERT=$cert" --change "ENV REQUESTS_CA_BUNDLE=$cert" --change "ENV SSL_CERT_FILE=$cert" \
  --change 'CMD ["/bin/bash"]' - "$first" >/dev/null
for tag in $tags; do docker tag "$first" "$tag"; done
echo "base-image.sh: built $tags" >&2
