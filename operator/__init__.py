"""The kopf operator: reconciles DecoupledDiLoCoJob resources into learner StatefulSets and a syncer."""
