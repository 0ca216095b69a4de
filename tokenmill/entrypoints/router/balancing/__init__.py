"""Which replica a request goes to: the policies, the prompt prefix they hash, stored responses
sent to the replica that holds them, and the replicas' health and load."""
