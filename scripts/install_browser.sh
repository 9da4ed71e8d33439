#!/usr/bin/env bash
# Headless Chromium for the dashboard's browser test (Debian packages; never a downloaded browser).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
else
  echo "stppo: the browser test needs Debian's chromium: run 'sudo apt-get install chromium chromium-driver'" >&2
fi
