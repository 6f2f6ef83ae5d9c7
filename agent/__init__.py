"""mrc-agent: the sidecar that samples the golden triangle (process user CPU, PCIe/NVLink
bandwidth, SM instructions per DRAM byte) next to an MRC service and exports it to Prometheus.
"""

__version__ = "0.1.0"
