"""The e2e scenario against a real cluster (KUBECONFIG), with the operator run locally."""
