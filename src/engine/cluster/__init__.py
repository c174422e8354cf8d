"""Scale-out: engine cores and API servers spread over processes and hosts.

The fleet of a host's engine cores (`fleet`), the authentication of the links between hosts
(`auth`), the messages of a deployment's topology and join handshake (`wire`), the DP
coordinator process (`coordinator`) and elastic data parallelism (`elastic_dp`,
`elastic_cluster`). Runs in the supervisor, the coordinator and (for the links) the frontends.
"""
