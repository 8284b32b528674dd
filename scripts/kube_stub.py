"""A stand-in Kubernetes API server for courier's tests.

There is no kube-apiserver on the test machines. kmock (PyPI) emulates one:
discovery, an object store, list/get and watch streams over the real wire
protocol. What kubectl and kube-runtime's watcher need beyond kmock 0.8 is
added here:

- every object gets metadata.uid, creationTimestamp, resourceVersion (one
  counter for the server) and generation (bumped when anything outside
  metadata and status changes);
- writes replace objects the way the API server does: POST creates (409 if it
  exists), PUT replaces, PATCH takes JSON merge patches (kubectl apply/edit
  on custom resources) and JSON patches, DELETE removes; the status
  subresource writes only status, the main resource never does;
- lists carry kind/apiVersion and a resourceVersion, and honor
  fieldSelector=metadata.name=...;
- watches are application/json, start after the requested resourceVersion,
  and end after timeoutSeconds; a resourceVersion the server never issued
  (it restarted) is answered with 410 Gone, so clients relist;
- applying a CustomResourceDefinition registers its resource (discovery,
  short names) and its schema under /openapi/v3;
- a SelfSubjectReview names the caller by its token (see `whoami`).

It does not validate objects against the CRD's schema: like a cluster with an
older CRD installed, it lets through what courier itself must refuse.

With --rbac, a request bearing the token `sa:NAMESPACE:NAME` is that service
account's, and may read RetryPolicies only in a namespace with a RoleBinding
to the ClusterRole courier-sidecar naming it as a subject; otherwise it gets
the API server's 403. Requests without a token (kubectl as the admin) may do
anything. Without the CRD, RetryPolicies are a 404, as on a real server.

Usage: kube_stub.py [--port N] [--rbac]; prints "READY <port>" once it listens.
All state is in memory: a restart is an empty cluster.
"""

import argparse
import asyncio
import copy
import datetime
import json
import time
import uuid

import aiohttp.web
import jsonpatch
import kmock

VERBS = ['create', 'delete', 'get', 'list', 'patch', 'update', 'watch']
BUILTIN = {
    'apiextensions.k8s.io/v1/customresourcedefinitions': dict(
        namespaced=False, kind='CustomResourceDefinition', singular='customresourcedefinition',
        shortnames=['crd', 'crds'], verbs=VERBS),
    'events.k8s.io/v1/events': dict(namespaced=True, kind='Event', singular='event',
                                    shortnames=['ev'], verbs=VERBS),
    '/v1/pods': dict(namespaced=True, kind='Pod', singular='pod', shortnames=['po'], verbs=VERBS),
    '/v1/namespaces': dict(namespaced=False, kind='Namespace', singular='namespace',
                           shortnames=['ns'], verbs=VERBS),
    # What the commands of docs/kubernetes.md touch (tests/commands/doc_commands.rs).
    '/v1/secrets': dict(namespaced=True, kind='Secret', singular='secret', shortnames=[],
                        verbs=VERBS),
    '/v1/serviceaccounts': dict(namespaced=True, kind='ServiceAccount',
                                singular='serviceaccount', shortnames=['sa'], verbs=VERBS),
    'apps/v1/deployments': dict(namespaced=True, kind='Deployment', singular='deployment',
                                shortnames=['deploy'], verbs=VERBS),
    'rbac.authorization.k8s.io/v1/rolebindings': dict(namespaced=True, kind='RoleBinding',
                                                      singular='rolebinding', shortnames=[],
                                                      verbs=VERBS),
    # `kubectl auth whoami` and courier's audit trail ask who they are.
    'authentication.k8s.io/v1/selfsubjectreviews': dict(
        namespaced=False, kind='SelfSubjectReview', singular='selfsubjectreview', shortnames=[],
        verbs=['create']),
}
SIDECAR_ROLE = 'courier-sidecar'


def status(code, reason, message, **details):
    body = {'apiVersion': 'v1', 'kind': 'Status', 'metadata': {}, 'status': 'Failure',
            'code': code, 'reason': reason, 'message': message, 'details': details}
    return aiohttp.web.json_response(body, status=code)


def merge_patch(target, patch):
    """RFC 7386: objects merge, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def body_of(obj):
    """What generation tracks: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ('metadata', 'status')}


class Stub(kmock.KubernetesEmulator):
    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        # Resource versions go on from where a stopped server left them
        # (as etcd's revision does), so a restart does not reuse them.
        self.version = int(time.time() * 1000)
        self.schemas = {}  # (group, version, kind) -> openAPIV3Schema
        self.rbac = False
        for key, info in BUILTIN.items():
            self.resources[key] = info

    def next_version(self):
        self.version += 1
        return str(self.version)

    async def _handle(self, request):
        path = request.url.path
        if path.startswith('/openapi/v3'):
            return self.openapi(path)
        if request.resource is None or request.resource.plural is None:
            return await super()._handle(request)
        refused = self.refused(request)
        if refused is not None:
            return refused
        if request.action == kmock.action.WATCH:
            return await self.watch(request)
        if request.resource.plural == 'selfsubjectreviews':
            return self.whoami(request)
        if request.method.upper() in ('POST', 'PUT', 'PATCH', 'DELETE'):
            if 'protobuf' in request.headers.get('Content-Type', ''):
                # kubectl's generators (create secret, create rolebinding)
                # send protobuf, which is not emulated: say so, instead of
                # failing to read it as JSON.
                return status(415, 'UnsupportedMediaType',
                              'protobuf is not emulated: kubectl create ... --dry-run=client -o json | kubectl create -f -')
            async with self._lock:
                return await self.write(request)
        return await super()._handle(request)

    def whoami(self, request):
        """A SelfSubjectReview: the token `sa:NAMESPACE:NAME` is that service
        account, `user:NAME` that user, no token the admin (as on kind)."""
        token = request.headers.get('Authorization', '').removeprefix('Bearer ').strip()
        if token.startswith('sa:'):
            _, account_ns, account = token.split(':', 2)
            user = {'username': f'system:serviceaccount:{account_ns}:{account}',
                    'groups': ['system:serviceaccounts', 'system:authenticated']}
        elif token.startswith('user:'):
            user = {'username': token.removeprefix('user:'), 'groups': ['system:authenticated']}
        else:
            user = {'username': 'kubernetes-admin', 'groups': ['system:masters', 'system:authenticated']}
        return aiohttp.web.json_response({
            'apiVersion': 'authentication.k8s.io/v1', 'kind': 'SelfSubjectReview',
            'metadata': {'creationTimestamp': None}, 'status': {'userInfo': user}}, status=201)

    def refused(self, request):
        """The 403 a service account gets reading RetryPolicies where no
        RoleBinding grants it courier-sidecar (with --rbac)."""
        token = request.headers.get('Authorization', '').removeprefix('Bearer ').strip()
        if not self.rbac or not token.startswith('sa:') or request.resource.plural != 'retrypolicies':
            return None
        _, account_ns, account = token.split(':', 2)
        namespace = request.namespace
        for (res, ns, _), obj in self._objects.items():
            if res.plural != 'rolebindings' or ns != namespace or obj.deleted:
                continue
            binding = obj.raw
            if binding.get('roleRef', {}).get('name') != SIDECAR_ROLE:
                continue
            for subject in binding.get('subjects') or []:
                if (subject.get('kind') == 'ServiceAccount' and subject.get('name') == account
                        and subject.get('namespace', ns) == account_ns):
                    return None
        verb = 'watch' if request.action == kmock.action.WATCH else (
            'get' if request.name else 'list')
        return status(
            403, 'Forbidden',
            f'retrypolicies.courier.dev is forbidden: User "system:serviceaccount:{account_ns}:{account}" '
            f'cannot {verb} resource "retrypolicies" in API group "courier.dev" in the namespace "{namespace}"',
            group='courier.dev', kind='retrypolicies')

    async def _serve_version(self, request):
        # kmock copies short names onto subresources; kubectl then warns
        # that "rp" could also mean retrypolicies/status.
        listed = await super()._serve_version(request)
        # kmock names the core group's version "/v1"; kubectl then finds
        # none of its resources (namespaces, secrets) by name.
        listed['groupVersion'] = listed['groupVersion'].lstrip('/')
        for resource in listed['resources']:
            if '/' in resource['name']:
                resource['shortNames'] = []
        return listed

    async def _serve_list(self, request):
        listed = await super()._serve_list(request)
        wanted = selected_name(request.params)
        info = self.resources[request.resource]
        group, version = request.resource.group, request.resource.version
        return {
            'apiVersion': f'{group}/{version}' if group else version,
            'kind': f'{info.kind}List',
            'metadata': {'resourceVersion': str(self.version)},
            'items': [o for o in listed['items'] if wanted in (None, o['metadata']['name'])],
        }

    async def write(self, request):
        method, res, data = request.method.upper(), request.resource, request.data
        namespace, name = request.namespace, request.name
        if method == 'POST' and name is None:
            meta = data.setdefault('metadata', {})
            name, namespace = meta.get('name'), namespace or meta.get('namespace')
            if not name:
                return status(422, 'Invalid', 'metadata.name: Required value')
            key = (res, namespace, name)
            if key in self._objects and not self._objects[key].deleted:
                return status(409, 'AlreadyExists', f'{res.plural} "{name}" already exists',
                              name=name, kind=res.plural)
            now = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now, generation=1,
                        resourceVersion=self.next_version())
            if namespace:
                meta['namespace'] = namespace
            return await self.store(key, data, 'ADDED', 201)
        key = (res, namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return status(404, 'NotFound', f'{res.plural} "{name}" not found',
                          name=name, kind=res.plural)
        current = copy.deepcopy(self._objects[key].raw)
        if method == 'DELETE':
            self._objects[key].delete()
            current['metadata']['resourceVersion'] = self.next_version()
            await self._buses[res].put({'type': 'DELETED', 'object': current})
            return aiohttp.web.json_response(current)
        if method == 'PUT':
            sent = data.get('metadata', {}).get('resourceVersion')
            if sent and sent != current['metadata']['resourceVersion']:
                return status(409, 'Conflict', 'the object has been modified; apply your changes to the latest version')
            new = data
        elif 'json-patch' in request.headers.get('Content-Type', ''):
            new = jsonpatch.apply_patch(current, data)
        elif 'apply-patch' in request.headers.get('Content-Type', ''):
            return status(415, 'UnsupportedMediaType', 'server-side apply is not emulated')
        else:
            new = merge_patch(current, data)
        if request.subresource == 'status':
            new = dict(current, status=new.get('status'))
        elif 'status' in self.resources[res].subresources:
            new = dict(new, status=current.get('status'))
        new = {k: v for k, v in new.items() if v is not None}
        meta = new['metadata'] = dict(new.get('metadata', {}))
        for field in ('uid', 'creationTimestamp', 'name', 'namespace', 'generation'):
            if field in current['metadata']:
                meta[field] = current['metadata'][field]
        if body_of(new) != body_of(current):
            meta['generation'] = current['metadata'].get('generation', 1) + 1
        meta['resourceVersion'] = self.next_version()
        return await self.store(key, new, 'MODIFIED', 200)

    async def store(self, key, obj, event, code):
        if key in self._objects:
            del self._objects[key]
        self._objects[key] = obj
        if key[0].group == 'apiextensions.k8s.io':
            self.register(obj)
        await self._buses[key[0]].put({'type': event, 'object': copy.deepcopy(obj)})
        return aiohttp.web.json_response(obj, status=code)

    def register(self, crd):
        spec, names = crd['spec'], crd['spec']['names']
        for version in spec['versions']:
            self.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = dict(
                namespaced=spec.get('scope') == 'Namespaced', kind=names['kind'],
                singular=names.get('singular'), shortnames=names.get('shortNames', []),
                verbs=VERBS, subresources=list((version.get('subresources') or {}).keys()))
            schema = version.get('schema', {}).get('openAPIV3Schema', {})
            self.schemas[(spec['group'], version['name'], names['kind'])] = schema

    def openapi(self, path):
        """One document per group/version. kubectl looks in it for a PATCH
        that takes fieldValidation; finding one, it leaves validation to the
        server instead of asking for /openapi/v2."""
        docs = {}
        for res in self.resources:
            info = self.resources[res]
            gv = f'apis/{res.group}/{res.version}' if res.group else f'api/{res.version}'
            gvk = {'group': res.group, 'version': res.version, 'kind': info.kind}
            scope = '/namespaces/{namespace}' if info.namespaced else ''
            doc = docs.setdefault(gv, {'openapi': '3.0.0', 'info': {'title': 'Kubernetes', 'version': 'v1.32.0'},
                                       'paths': {}, 'components': {'schemas': {}}})
            doc['paths'][f'/{gv}{scope}/{res.plural}/{{name}}'] = {'patch': {
                'x-kubernetes-group-version-kind': gvk, 'responses': {},
                'parameters': [{'name': 'fieldValidation', 'in': 'query', 'schema': {'type': 'string'}}]}}
            schema = self.schemas.get((res.group, res.version, info.kind))
            if schema is not None:
                prefix = '.'.join(reversed(res.group.split('.')))
                doc['components']['schemas'][f'{prefix}.{res.version}.{info.kind}'] = dict(
                    schema, **{'x-kubernetes-group-version-kind': [gvk]})
        if path.rstrip('/') == '/openapi/v3':
            return aiohttp.web.json_response({'paths': {
                gv: {'serverRelativeURL': f'/openapi/v3/{gv}'} for gv in docs}})
        gv = path.removeprefix('/openapi/v3/').strip('/')
        if gv not in docs:
            return status(404, 'NotFound', f'no OpenAPI document for {gv}')
        return aiohttp.web.json_response(docs[gv])

    async def watch(self, request):
        res, namespace = request.resource, request.namespace
        wanted = request.name or selected_name(request.params)
        since = int(request.params.get('resourceVersion') or 0) if (
            request.params.get('resourceVersion') or '0').isdigit() else 0
        timeout = float(request.params.get('timeoutSeconds') or 0) or None

        def ours(obj):
            meta = obj.get('metadata', {})
            return (namespace in (None, meta.get('namespace'))
                    and wanted in (None, meta.get('name')))

        async with self._lock:
            mark = await self._buses[res].mark()
            existing = [copy.deepcopy(o.raw) for (r, _, _), o in self._objects.items()
                        if r == res and not o.deleted]
        response = aiohttp.web.StreamResponse(headers={'Content-Type': 'application/json'})
        await response.prepare(request._raw_request)

        async def send(event):
            await response.write(json.dumps(event).encode() + b'\n')

        async def stream():
            for obj in existing:
                if ours(obj) and int(obj['metadata']['resourceVersion']) > since:
                    await send({'type': 'ADDED', 'object': obj})
            async for event in self._buses[res].stream(since=mark):
                if ours(event['object']):
                    await send(event)

        try:
            if since > self.version:
                # A version this server never issued: it restarted, as after
                # an outage. Gone, so the client relists.
                await send({'type': 'ERROR', 'object': {
                    'apiVersion': 'v1', 'kind': 'Status', 'status': 'Failure', 'code': 410,
                    'reason': 'Expired', 'message': f'too old resource version: {since}'}})
                return response
            await asyncio.wait_for(stream(), timeout)
        except (asyncio.TimeoutError, ConnectionResetError):
            pass
        finally:
            await self._buses[res].unmark(mark)
        return response


def selected_name(params):
    for term in (params.get('fieldSelector') or '').split(','):
        field, _, value = term.partition('=')
        if field == 'metadata.name':
            return value.lstrip('=')
    return None


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--port', type=int, default=0)
    parser.add_argument('--rbac', action='store_true')
    args = parser.parse_args()
    handler = Stub()
    handler.rbac = args.rbac
    async with handler, kmock.Server(handler, port=args.port) as server:
        print(f'READY {server.port}', flush=True)
        await asyncio.Event().wait()


if __name__ == '__main__':
    asyncio.run(main())
