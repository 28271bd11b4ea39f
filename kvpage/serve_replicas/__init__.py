"""Scale-out (`kvpage serve --replicas N`, the optional `ray` extra): engine replicas on Ray Serve
behind a prefix-affinity router. The routing tree and policy (prefix_tree, prefix_router), the
routing key, the ASGI bridge and the metrics merge are plain Python; only ray_router and
ray_serve import Ray, and nothing imports them unless replicas are asked for."""
