#!/bin/sh
# Issues this pod's Ray TLS certificate, signed by the cluster's CA (Secret
# hybrid-iter-ray-tls-ca), run by the init container ray-tls-cert of every Ray pod.
#
# Ray's gRPC clients check the server's certificate against the address they dial: the
# pod's IP (raylets, object managers, workers), 127.0.0.1 (processes of the same pod) and,
# for the head, its Service's DNS names (the workers' GCS address). Pod IPs are known
# only once the pod exists, hence one certificate per pod, made here. The same
# certificate is the pod's client certificate (Ray's TLS is mutual).
#
# Environment: POD_IP; TLS_CA_DIR (the CA Secret's ca.crt and ca.key); TLS_DIR (where
# tls.key, tls.crt and ca.crt go: the memory volume the Ray containers mount); optional
# POD_NAME, TLS_DNS_NAMES (space-separated extra DNS names), TLS_CERT_DAYS (default 365).
set -eu

: "${POD_IP:?POD_IP is not set: give it the pod IP (downward API status.podIP)}"
: "${TLS_CA_DIR:?TLS_CA_DIR is not set: the directory of the CA Secret}"
: "${TLS_DIR:?TLS_DIR is not set: the directory the certificate goes to}"
ca_dir=$TLS_CA_DIR
out=$TLS_DIR
days=${TLS_CERT_DAYS:-365}
for f in ca.crt ca.key; do
  if [ ! -s "$ca_dir/$f" ]; then
    echo "ray-tls-cert: $ca_dir/$f is missing: create the Secret hybrid-iter-ray-tls-ca with keys ca.crt and ca.key (k8s/README.md, \"Ray TLS\")" >&2
    exit 1
  fi
done

umask 077
work=$(mktemp -d "${TMPDIR:-/tmp}/ray-tls.XXXXXX")
trap 'rm -rf "$work"' EXIT

san="IP:$POD_IP,IP:127.0.0.1,DNS:localhost"
for name in ${TLS_DNS_NAMES:-}; do
  san="$san,DNS:$name"
done
cat > "$work/ext.cnf" <<EOF
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = $san
EOF

# An EC P-256 key, made here and never leaving the pod's memory volume.
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout "$out/tls.key" -subj "/O=hybrid-iter/CN=${POD_NAME:-ray}" -out "$work/req.csr" \
  2> "$work/req.log" || { cat "$work/req.log" >&2; exit 1; }
serial="0x$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
openssl x509 -req -in "$work/req.csr" -CA "$ca_dir/ca.crt" -CAkey "$ca_dir/ca.key" \
  -set_serial "$serial" -days "$days" -sha256 -extfile "$work/ext.cnf" \
  -out "$out/tls.crt" 2> "$work/x509.log" || { cat "$work/x509.log" >&2; exit 1; }
cp "$ca_dir/ca.crt" "$out/ca.crt"
openssl verify -CAfile "$out/ca.crt" "$out/tls.crt" > /dev/null
echo "ray-tls-cert: issued $out/tls.crt for $san, valid $days days"
