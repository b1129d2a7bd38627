"""The model families artrl knows, exercised: tiny models of each family built offline, `artrl check-template`."""
