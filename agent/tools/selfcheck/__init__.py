"""``mrc-agent selfcheck``: the agent's GPU readings checked against a reference measured in
the same run (copies and GEMMs of known size on the GPU, or the simulated GPU with ``--dry``).

``command`` (the subcommand and the rig), ``phases`` (the workload's phases and the readers
that watch them), ``sampler`` (the agent's readers in a child process, as in the sidecar),
``compare`` (each reading against its reference, with its tolerance and why), ``pcie`` (the
PCIe counters' cadence), ``timeline`` (the hardware activity timeline's idle windows against
idle gaps made on purpose), ``workload`` (the GPU work of known size), and the simulated GPU
the dry run reads through the agent's real adapters: ``dry`` (the model) and ``dry_device`` (the
model written into the simulated pynvml and cupti-python of ``agent/tools/simgpu``).
docs/gpu-truth.md.
"""
