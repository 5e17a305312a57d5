"""The router: public HTTP edge, agent control plane, dispatch and health."""
