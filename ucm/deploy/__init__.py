"""The UCMDeployment resource: spec models (:mod:`.spec`) and the CRD generated from them (:mod:`.crd`)."""
