"""Where the agent learns its pods and policy: Kubernetes watches or YAML files."""
