package app

import (
	"context"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"

	"bmeg.dev/testbed/internal/rpc"
)

// nginx-web-server: the front end of DeathStarBench's wrk2 API. Parameters come as a query
// string or a form body, as wrk2's scripts send them; each route is one call to a service.
var nginx = Service{
	Name: "nginx-web-server",
	Peers: []string{"compose-post-service", "home-timeline-service", "user-timeline-service",
		"user-service", "social-graph-service"},
	Register: func(e *Env, s *rpc.Server) {
		route := func(path string, h func(ctx context.Context, f form) (any, error)) {
			s.HandleHTTP(path, path, func(w http.ResponseWriter, r *http.Request) {
				if err := r.ParseForm(); err != nil {
					rpc.Fail(w, r, badRequest("form: %v", err))
					return
				}
				out, err := h(r.Context(), form{r})
				if err != nil {
					rpc.Fail(w, r, err)
					return
				}
				rpc.Reply(w, out)
			})
		}
		route("/wrk2-api/post/compose", func(ctx context.Context, f form) (any, error) {
			req := ComposePostRequest{ReqID: rand.Int64(), Username: f.get("username"), Text: f.get("text")}
			var err error
			if req.UserID, err = f.int("user_id"); err != nil {
				return nil, err
			}
			if req.PostType, err = f.optionalInt("post_type"); err != nil {
				return nil, err
			}
			if req.MediaIDs, err = f.ints("media_ids"); err != nil {
				return nil, err
			}
			req.MediaTypes = f.list("media_types")
			return Empty{}, e.Peers.Call(ctx, "compose-post-service", "compose_post", req, nil)
		})
		timeline := func(peer, op string) func(context.Context, form) (any, error) {
			return func(ctx context.Context, f form) (any, error) {
				var req TimelineRead
				var err error
				if req.UserID, err = f.int("user_id"); err != nil {
					return nil, err
				}
				if req.Start, err = f.optionalInt("start"); err != nil {
					return nil, err
				}
				if req.Stop, err = f.optionalInt("stop"); err != nil {
					return nil, err
				}
				if req.Stop == 0 {
					req.Stop = req.Start + 10
				}
				out := &Posts{}
				return out, e.Peers.Call(ctx, peer, op, req, out)
			}
		}
		route("/wrk2-api/home-timeline/read", timeline("home-timeline-service", "read_home_timeline"))
		route("/wrk2-api/user-timeline/read", timeline("user-timeline-service", "read_user_timeline"))
		route("/wrk2-api/user/register", func(ctx context.Context, f form) (any, error) {
			id, err := f.int("user_id")
			if err != nil {
				return nil, err
			}
			return Empty{}, e.Peers.Call(ctx, "user-service", "register_user", RegisterRequest{UserID: id,
				Username: f.get("username"), FirstName: f.get("first_name"), LastName: f.get("last_name"),
				Password: f.get("password")}, nil)
		})
		route("/wrk2-api/user/login", func(ctx context.Context, f form) (any, error) {
			out := &LoginResponse{}
			return out, e.Peers.Call(ctx, "user-service", "login",
				LoginRequest{Username: f.get("username"), Password: f.get("password")}, out)
		})
		follow := func(op string) func(context.Context, form) (any, error) {
			return func(ctx context.Context, f form) (any, error) {
				if f.get("user_name") != "" || f.get("followee_name") != "" {
					return Empty{}, e.Peers.Call(ctx, "social-graph-service", op+"_with_username",
						FollowNamesRequest{UserName: f.get("user_name"), FolloweeName: f.get("followee_name")}, nil)
				}
				a, err := f.int("user_id")
				if err != nil {
					return nil, err
				}
				b, err := f.int("followee_id")
				if err != nil {
					return nil, err
				}
				return Empty{}, e.Peers.Call(ctx, "social-graph-service", op, FollowRequest{UserID: a, FolloweeID: b}, nil)
			}
		}
		route("/wrk2-api/user/follow", follow("follow"))
		route("/wrk2-api/user/unfollow", follow("unfollow"))
	},
}

// form reads wrk2 parameters.
type form struct{ r *http.Request }

func (f form) get(name string) string { return f.r.Form.Get(name) }

func (f form) int(name string) (int64, error) {
	v, err := strconv.ParseInt(f.get(name), 10, 64)
	if err != nil {
		return 0, badRequest("parameter %s: want an integer, got %q", name, f.get(name))
	}
	return v, nil
}

func (f form) optionalInt(name string) (int, error) {
	if f.get(name) == "" {
		return 0, nil
	}
	v, err := f.int(name)
	return int(v), err
}

// list reads "a,b,c" or wrk2's JSON-ish "[a,b,c]" / `["a","b"]`.
func (f form) list(name string) []string {
	s := strings.Trim(strings.TrimSpace(f.get(name)), "[]")
	if s == "" {
		return []string{}
	}
	parts := strings.Split(s, ",")
	for i, p := range parts {
		parts[i] = strings.Trim(strings.TrimSpace(p), `"`)
	}
	return parts
}

func (f form) ints(name string) ([]int64, error) {
	parts := f.list(name)
	out := make([]int64, len(parts))
	for i, p := range parts {
		v, err := strconv.ParseInt(p, 10, 64)
		if err != nil {
			return nil, badRequest("parameter %s: item %d is not an integer: %q", name, i, p)
		}
		out[i] = v
	}
	return out, nil
}
