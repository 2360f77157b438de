#!/usr/bin/env bash
# Installs what the Vulkan backend needs on Debian/Ubuntu (run as root, before scripts/install.sh):
# its build tools (the Vulkan headers and loader, glslc, SPIRV-Headers) and Mesa's drivers, among
# them lavapipe, a Vulkan driver that runs on the CPU, so the GPU tests run on any machine. A real
# GPU needs its vendor's Vulkan driver (Mesa's radv for AMD, NVIDIA's own) in place of or beside it.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends libvulkan-dev glslc spirv-headers mesa-vulkan-drivers
