"""The UCM operator: reconciles ``UCMDeployment`` resources into running serving stacks."""
