"""What fault injection and mitigation both do to a cluster, below both of them.

- `catalogue`: the tunable parameters per kind of service (range, default, change cost, how a
  value reaches the service), read from the shipped `parameters.yaml`;
- `executor`: the `Applied` record of one change (values before and after) and the `Executor`
  protocol every backend implements, so any change can be undone;
- `kubernetes`: `KubernetesExecutor`, which changes a Deployment (replicas, limits, a parameter,
  anti-affinity) and rolls it back, with the official client.

`bmeg.faultinject.kubernetes` uses these to inject faults (a bad parameter, shrunk limits) and
`bmeg.mitigation` to repair them; neither imports the other.
"""
