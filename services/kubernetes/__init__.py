"""ringwatch and the Kubernetes API: the service account's connection to it (``client``), and
the remediation that labels and taints nodes by ringwatch's verdicts (``remediation``,
docs/kubernetes.md, "Remediation"). The standard library and httpx only: a client command."""
