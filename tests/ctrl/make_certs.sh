#!/bin/sh
# make_certs.sh DIR: the PEM files of the control-plane TLS tests, made with openssl at test
# time (P-256 keys, valid two days):
#   ca.pem             the cluster's CA;  node.pem / node.key: a certificate it signed
#   other-ca.pem       another CA;        other.pem / other.key: a certificate that one signed
#   self.pem / self.key                   a self-signed certificate (no CA at all)
# Exits 77 (ctest's skip code in tests/ctrl.cmake) when openssl is not installed (Debian
# package openssl, which scripts/setup.sh installs).
set -eu
dir=$1
if ! command -v openssl >/dev/null 2>&1; then
  echo "make_certs.sh: openssl not found (install the Debian package openssl): skipped" >&2
  exit 77
fi
mkdir -p "$dir"
cd "$dir"
cat >openssl.cnf <<'CNF'
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[leaf]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = DNS:localhost,IP:127.0.0.1
CNF
EC="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
# mk_ca NAME CN
mk_ca() {
  openssl req -config openssl.cnf -x509 -new $EC -keyout "$1.key" -out "$1.pem" -days 2 \
    -subj "/CN=$2" -extensions ca 2>/dev/null
}
# mk_leaf NAME CA CN
mk_leaf() {
  openssl req -config openssl.cnf -new $EC -keyout "$1.key" -out "$1.csr" -subj "/CN=$3" \
    2>/dev/null
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -out "$1.pem" \
    -days 2 -extfile openssl.cnf -extensions leaf 2>/dev/null
  rm -f "$1.csr"
}
mk_ca ca "tandem test CA"
mk_leaf node ca "tandem node"
mk_ca other-ca "another CA"
mk_leaf other other-ca "tandem node"
openssl req -config openssl.cnf -x509 -new $EC -keyout self.key -out self.pem -days 2 \
  -subj "/CN=tandem node" -extensions leaf 2>/dev/null
chmod 600 ./*.key
