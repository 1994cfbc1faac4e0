# Two entry points on a fresh Debian 12 machine: `make run` and `make test`.
# Everything they need is installed from here (apt as root, pip into .venv).

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
APPLIANCE := $(VENV)/bin/appliance
APT_PACKAGES := python3 python3-venv python3-pip python3-systemd python3-cryptography espeak-ng curl systemd systemd-container debootstrap \
	python3-bpfcc bpftool linux-headers-amd64 util-linux
DEV_KEY := keys/dev.key
TRUSTED := keys/trusted
BUNDLE := build/firmware/default
CONFIG := etc/dev.toml

.PHONY: run test bench deps bpf-host venv firmware clean

run: firmware run/tls/cert.pem bpf-host
	@echo "appliance: serving $(BUNDLE) on ./run/api.sock and QUIC 127.0.0.1:4433. Try, from another terminal:"
	@echo "  $(APPLIANCE) call health"
	@echo "  $(APPLIANCE) call models"
	@echo "  $(APPLIANCE) call vad speech.wav"
	@echo "  curl --unix-socket ./run/api.sock http://localhost/v2/health/ready"
	@echo "  $(APPLIANCE) call --quic 127.0.0.1:4433 --cafile run/tls/cert.pem models"
	$(APPLIANCE) run --config $(CONFIG)

test: firmware bpf-host
	bash tests/run.sh

bench: firmware
	$(APPLIANCE) bench --bundle $(BUNDLE) --trusted-keys $(TRUSTED)

# Debian packages: only asks apt when one is missing, so a warm machine skips the network.
deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "apt-get install $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# Kernel headers findable and bpffs mounted, for the eBPF connection cache (cheap; every run).
bpf-host: | deps
	@if [ "$$(id -u)" = 0 ]; then bpf/setup-host.sh; else echo "not root: the eBPF connection cache falls back to user space"; fi

$(VENV)/.installed: pyproject.toml | deps
	/usr/bin/python3 -m venv --system-site-packages $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	# silero-vad only carries the model file for the firmware build; --no-deps keeps torch out.
	$(VENV)/bin/pip install -q --no-deps 'silero-vad>=5'
	touch $@

venv: $(VENV)/.installed

$(DEV_KEY): | venv
	$(APPLIANCE) keys new --out $(DEV_KEY) --trust-dir $(TRUSTED)

$(BUNDLE)/manifest.json: firmware/default.toml $(DEV_KEY) | venv
	$(APPLIANCE) firmware build firmware/default.toml --key $(DEV_KEY) --out $(BUNDLE)

firmware: $(BUNDLE)/manifest.json

run/tls/cert.pem: | venv
	$(APPLIANCE) tls init --cert run/tls/cert.pem --key run/tls/key.pem

clean:
	rm -rf build run
